"""CPU accounting of process trees from /proc: the time of children that exit between samples
is counted (the parent's cutime/cstime once it reaps them), and a component's total never goes
down when its root is restarted."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from benchmarks.sampling import ProcessSampler

CHILDREN = 4
BURN_S = 0.25  # CPU each child burns before exiting

# A parent that starts short-lived children one after the other, each burning BURN_S of CPU and
# printing its own CPU time with its unique id, then waits to be stopped (alive, so its tree is
# still sampled at the phase's end).
PARENT = textwrap.dedent(
    f"""
    import subprocess, sys, time
    sys.stdin.readline()  # the test watches this process first
    child = (
        "import sys, time\\n"
        "began = time.process_time()\\n"
        "while time.process_time() - began < {BURN_S}:\\n"
        "    pass\\n"
        "print(sys.argv[1], time.process_time(), flush=True)\\n"
    )
    for n in range({CHILDREN}):
        subprocess.run([sys.executable, "-c", child, f"child-{{n}}"], check=True)
    print("done", flush=True)
    time.sleep(60)
    """
)


def _start_parent(sampler: ProcessSampler) -> subprocess.Popen[str]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    sampler.watch("tree", parent.pid)
    return parent


def _children_of(parent: subprocess.Popen[str]) -> dict[str, float]:
    """Lets the parent start its children; their own CPU seconds by id once all exited."""
    assert parent.stdin is not None
    assert parent.stdout is not None
    parent.stdin.write("go\n")
    parent.stdin.flush()
    own: dict[str, float] = {}
    for line in parent.stdout:
        name, _, cpu = line.strip().partition(" ")
        if name == "done":
            break
        own[name] = float(cpu)
    return own


def _stop(parent: subprocess.Popen[str]) -> None:
    parent.kill()
    parent.wait()
    for pipe in (parent.stdin, parent.stdout):
        assert pipe is not None
        pipe.close()


def test_cpu_of_children_that_exited_between_samples_is_counted():
    # Samples only at the phase's ends: every child starts and exits between two samples.
    sampler = ProcessSampler(interval_s=3600)
    parent = _start_parent(sampler)
    try:
        with sampler.phase("children"):
            own = _children_of(parent)
    finally:
        _stop(parent)
    assert sorted(own) == [f"child-{n}" for n in range(CHILDREN)]
    children_s = sum(own.values())
    assert children_s >= CHILDREN * BURN_S
    used = sampler.summary()["children"]["tree"]["cpu_s"]
    # The children's own time, plus the parent's (its start-up and theirs); tick granularity.
    assert used >= children_s - 0.05, (used, own)
    assert used < children_s + 2.0, (used, own)


def test_a_restarted_component_adds_to_what_it_used_before():
    sampler = ProcessSampler(interval_s=3600)
    parent = _start_parent(sampler)
    with sampler.phase("restarts"):
        first = _children_of(parent)
        sampler.sample_now()
        _stop(parent)  # its tree is gone: the total keeps what it had used
        sampler.sample_now()
        again = _start_parent(sampler)  # watch() with the new PID: a restart
        second = _children_of(again)
    _stop(again)
    used = sampler.summary()["restarts"]["tree"]["cpu_s"]
    both = sum(first.values()) + sum(second.values())
    assert used >= both - 0.1, (used, both)
    totals = [s.cpu_s for s in sampler.samples]
    assert totals == sorted(totals)  # cumulative: never down
