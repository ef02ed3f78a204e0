"""Every figure README.md and benchmarks/RESULTS.md quote is in the JSON they cite.

A benchmark writes benchmarks/results/<name>.json and the section `<!-- BEGIN name -->` of
RESULTS.md from one run; README restates some of those figures by hand. Each number in a
RESULTS.md section, and in README's figure passages (the status paragraph's benchmark sentence
and the "Benchmarks" section), must be found in the JSON it cites, at the precision shown
(`0.68` matches 0.675..0.685, `~89,000` matches 88,500..89,500; a percentage may be a share).
A figure computed from the JSON (a ratio, a difference) is listed in DERIVED with how it is
computed; a number that is no measurement (a setting, an issue number, a status code) is listed
in NOT_FIGURES with the reason. Anything else fails: a figure from another run, a range built
from runs that are not committed, a sum of medians of different rounds.

And each JSON records the revision it measured, which its RESULTS.md section must quote.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_JSON = ROOT / "benchmarks" / "results"

# A number as prose writes it: 1,234.5, 0.68, -3.0, 16 (not inside words such as KIP-535,
# user-296, gh-103200 or a commit hash).
_SIGN = "[-\N{MINUS SIGN}+]?"
_NUMBER = re.compile(
    rf"(?<![\w.\-/#])(~?{_SIGN}\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|~?{_SIGN}\d+(?:\.\d+)?)(?!\w|\.\d)"
)
# Spans that hold no figure: code (commands, settings), link targets, dates, clock times.
_NOT_PROSE = re.compile(
    r"```.*?```|`[^`]*`|\]\([^)]*\)|\d{4}-\d{2}-\d{2}( \d{2}:\d{2} UTC)?|<!--.*?-->", re.S
)
# Sections written before results JSONs recorded their revision; remove a name once its
# benchmark is re-run (the test says so).
NO_REVISION_YET: set[str] = set()

Json = dict[str, Any]


@dataclass(frozen=True)
class Passage:
    """Text that quotes one or more results JSONs (all of it, or the subtrees named)."""

    name: str
    text: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]  # (json name, key path to a subtree)
    derived: dict[str, Callable[[dict[str, Json]], float]] = field(default_factory=dict)
    not_figures: dict[str, str] = field(default_factory=dict)


def _load(name: str) -> Json:
    return json.loads((RESULTS_JSON / f"{name}.json").read_text())


def _numbers(node: Any, skip: frozenset[str] = frozenset({"timeline"})) -> Iterator[Decimal]:
    """Every number in a JSON subtree: values, numeric keys, numbers inside strings."""
    if isinstance(node, bool) or node is None:
        return
    if isinstance(node, int | float):
        yield Decimal(repr(node))
    elif isinstance(node, str):
        for found in re.findall(r"-?\d+(?:\.\d+)?", node):
            yield Decimal(found)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in skip:
                continue
            yield from _numbers(key, skip)
            yield from _numbers(value, skip)
    elif isinstance(node, list):
        for item in node:
            yield from _numbers(item, skip)


def _tolerance(quoted: str) -> tuple[Decimal, Decimal]:
    """(the number, half a unit of its last digit shown); `~` makes trailing zeros rough."""
    approximate = quoted.startswith("~")
    digits = quoted.lstrip("~").replace(",", "").replace("\N{MINUS SIGN}", "-")
    number = Decimal(digits)
    exponent = number.as_tuple().exponent
    assert isinstance(exponent, int)
    if approximate and exponent == 0:
        stripped = digits.rstrip("0")
        exponent = len(digits) - len(stripped) if stripped not in ("", "-", "+") else 0
    return number, Decimal(10) ** exponent / 2


def shown_as(quoted: str, value: float | Decimal) -> bool:
    return in_pool(quoted, sorted({abs(float(value))}))


def in_pool(quoted: str, pool: list[float]) -> bool:
    """Whether a sorted list of absolute values holds one that `quoted` shows (as itself, or a
    share as a percentage)."""
    number, half = _tolerance(quoted)
    for scale in (1, 100):
        low = float((abs(number) - half) / scale) - 1e-12
        high = float((abs(number) + half) / scale) + 1e-12
        at = bisect.bisect_left(pool, low)
        if at < len(pool) and pool[at] <= high:
            return True
    return False


def figures_in(text: str) -> list[str]:
    prose = _NOT_PROSE.sub(" ", text)
    return [m.group(1) for m in _NUMBER.finditer(prose)]


def unmatched(passage: Passage) -> list[str]:
    loaded = {name: _load(name) for name, _ in passage.sources}
    values: set[float] = set()
    for name, path in passage.sources:
        node: Any = loaded[name]
        for key in path:
            node = node[key]
        values.update(abs(float(number)) for number in _numbers(node))
    pool = sorted(values)
    wrong = []
    for quoted in figures_in(passage.text):
        bare = quoted.lstrip("~+-\N{MINUS SIGN}")
        if bare in passage.not_figures:
            continue
        compute = passage.derived.get(bare)
        if compute is not None:
            if not shown_as(quoted, compute(loaded)):
                wrong.append(f"{quoted} (derived: computes {compute(loaded)!r})")
            continue
        if not in_pool(quoted, pool):
            wrong.append(quoted)
    return wrong


# -- benchmarks/RESULTS.md: each section against the JSON its benchmark wrote ------------------


def results_sections() -> dict[str, str]:
    text = RESULTS_MD.read_text()
    return dict(re.findall(r"<!-- BEGIN (\w+) -->\n(.*?)<!-- END \1 -->", text, re.S))


SECTION_NOT_FIGURES: dict[str, dict[str, str]] = {
    "partitioner": {},
    "materializer": {
        "20,000": "records per partition per batch (a setting)",
        "8": "wrk's connections (a setting)",
        "6": "partitions (a setting)",
        "20": "writes/s (a setting)",
        # "Where the time goes": measurements made while building the node, which the section
        # presents as such, not figures of this run.
        "65": "earlier measurement",
        "140": "earlier measurement",
        "1.5": "earlier measurement",
        "1.1": "earlier measurement",
        "0.71": "earlier measurement",
        "0.35": "earlier measurement",
        "0.41": "earlier measurement",
        "68": "earlier measurement",
        "0.15": "earlier measurement",
        "0.005": "earlier measurement",
        "0.3": "earlier measurement",
    },
    "proxy": {
        "5": "issue #5",
        "17": "issue #17",
        "20": "issue #20",
        "100,000": "the key space (a setting)",
        "60": "the lag budget's 60 s (a setting)",
    },
    "system": {"535": "KIP-535", "503": "a status code (column title)"},
    "slow_nodes": {
        "19": "issue 19",
        "503": "a status code",
        "15": "the load average's 15 minutes",
        "10": "10 s (a setting)",
        "8": "8 s (a setting)",
    },
    "front_existing": {
        "18": "issue 18",
        "500": "a status code",
        "503": "a status code",
        "8": "connections per client (a setting)",
        "6": "Faust's session timeout in the test app (a setting)",
    },
    "soak": {"16": "connections (a setting)", "9": "kill -9 (a signal)"},
    "node_forward": {
        "24": "issue 24",
        "1": "the load average's 1 minute",
        "5": "the load average's 5 minutes",
        "15": "the load average's 15 minutes",
    },
    "control_plane": {"22": "issue 22"},
    "control_plane_ages_move": {"22": "issue 22"},
    "metrics_render": {"22": "issue 22"},
}


def _ratio(a: tuple[str, ...], b: tuple[str, ...]) -> Callable[[dict[str, Json]], float]:
    def compute(loaded: dict[str, Json]) -> float:
        (data,) = loaded.values()
        top, bottom = data, data
        for key in a:
            top = top[key]
        for key in b:
            bottom = bottom[key]
        return float(top) / float(bottom)  # type: ignore[arg-type]

    return compute


SECTION_DERIVED: dict[str, dict[str, Callable[[dict[str, Json]], float]]] = {
    "partitioner": {  # the last column: murmur2_c / mmh3 of each row
        "0.79": _ratio(("ns_per_key", "16", "murmur2_c"), ("mmh3_ns_per_key", "16")),
        "0.85": _ratio(("ns_per_key", "64", "murmur2_c"), ("mmh3_ns_per_key", "64")),
        "1.10": _ratio(("ns_per_key", "256", "murmur2_c"), ("mmh3_ns_per_key", "256")),
    },
    "materializer": {
        "0.47": _ratio(("lookups_while_ingesting", "rps"), ("lookups_idle", "rps")),
        "10.7": _ratio(("lookups_while_ingesting", "p99_ms"), ("lookups_idle", "p99_ms")),
    },
    "slow_nodes": {
        "0.46": _ratio(
            ("slow_node", "sigstop", "hedged", "p99_ms"),
            ("slow_node", "sigstop", "plain", "p99_ms"),
        ),
        "0.04": _ratio(
            ("slow_node", "sigstop", "hedged", "max_ms"),
            ("slow_node", "sigstop", "plain", "max_ms"),
        ),
    },
}


def _section_passages() -> list[Passage]:
    return [
        Passage(
            name,
            text,
            ((name, ()),),
            SECTION_DERIVED.get(name, {}),
            # A partial system run (`--only`) writes system_<claims>: the same prose.
            SECTION_NOT_FIGURES.get(
                name.split("_", 1)[0] if name.startswith("system_") else name, {}
            ),
        )
        for name, text in results_sections().items()
    ]


@pytest.mark.parametrize("passage", _section_passages(), ids=lambda p: p.name)
def test_every_figure_of_a_results_section_is_in_its_json(passage: Passage):
    assert (RESULTS_JSON / f"{passage.name}.json").exists(), f"{passage.name}: no JSON"
    assert unmatched(passage) == [], f"RESULTS.md section {passage.name}: not in its JSON"


@pytest.mark.parametrize("name", sorted(results_sections()))
def test_a_results_section_quotes_the_revision_its_json_measured(name: str):
    data = _load(name)
    if name in NO_REVISION_YET:
        # Rewritten since by a partial run (a new key): still no revision for the old figures.
        recorded = data.get("revision", "not recorded")
        assert recorded == "not recorded", f"{name}.json has a revision now: drop it from the list"
        return
    revision = data["revision"]
    # Recorded as a commit and a dirty flag (older files: "<commit>+changes").
    shown = f"{revision}+changes" if data.get("dirty") else revision
    assert re.search(rf"\b{re.escape(shown)}\b", results_sections()[name]), shown


# -- README: its figure sentences against the JSONs they cite -----------------------------------


def readme_passage(start: str, end: str | None) -> str:
    """README's text from `start` up to (not including) `end` (None: to the end of the file
    or the next section)."""
    text = README.read_text()
    assert start in text, f"README no longer has {start!r}: update tests/test_figures.py"
    rest = text[text.index(start) :]
    if end is None:
        return rest.split("\n## ", 1)[0]
    assert end in rest, f"README no longer has {end!r} after {start!r}"
    return rest[: rest.index(end)]


def _small_rps(loaded: dict[str, Json], system: str) -> float:
    return float(loaded["proxy"]["by_size"]["small"]["systems"][system]["rps"])


def _system(*path: str) -> tuple[str, tuple[str, ...]]:
    return ("system", path)


def _get(data: Json, *path: str) -> Any:
    for key in path:
        data = data[key]
    return data


def _node_memory_change(loaded: dict[str, Json], pick: Callable[..., float]) -> float:
    memory = loaded["system"]["soak"]["memory"]
    return pick(
        m["last_minute_mb"] - m["first_minute_mb"]
        for component, m in memory.items()
        if component.startswith("node-")
    )


def _readme_passages() -> list[Passage]:
    hop = "1_no_extra_hop"
    cores = {"2": "this machine's 2 cores"}
    return [
        Passage(
            "status",
            readme_passage("clock. Against clients going straight", "## Set-up"),
            (_system(hop), ("node_forward", ())),
            not_figures={**cores, "25": "the goal: within 25%"},
        ),
        Passage(
            "partitioner",
            readme_passage("Latest figures are in", "One node on this machine"),
            (
                ("partitioner", ("ns_per_key", "16")),  # the 16-byte row
                ("proxy", ("partition_step_ns",)),
                ("proxy", ("partition_step_share_of_kroute_cpu",)),
            ),
            derived={
                "2.8": lambda j: (
                    _get(j["partitioner"], "ns_per_key", "16", "murmur2_python") / 1000
                ),  # ns -> µs
            },
            not_figures={"16": "16-byte keys (which row)"},
        ),
        Passage(
            "materializer",
            readme_passage("One node on this machine", "The proxy (`benchmarks/proxy_bench.py`"),
            (("materializer", ()),),
            not_figures={"6": "partitions (a setting)"},
        ),
        Passage(
            "proxy",
            readme_passage("The proxy (`benchmarks/proxy_bench.py`", "The seeds' claims"),
            (("proxy", ()),),
            derived={
                "1.075": lambda j: _small_rps(j, "haproxy-2t") / _small_rps(j, "haproxy"),
                "1.121": lambda j: _small_rps(j, "nginx-2w") / _small_rps(j, "nginx"),
            },
            not_figures={
                **cores,
                "1.7": "the issue-20 goal: 1.7x",
                "20": "issue 20",
                "50": "connections (a setting)",
                "52": "the small answer's size",
                "16": "16 KiB answers",
                "1": "1 MiB answers",
                "64": "kroute's 64 KiB buffer",
                "17": "issue 17",
            },
        ),
        Passage(
            "system set-up",
            readme_passage("The seeds' claims on one real cluster", "- **No extra hop.**"),
            (_system("settings"),),
            not_figures={**cores, "45": "the grace period (a setting)"},
        ),
        Passage(
            "no extra hop",
            readme_passage("- **No extra hop.**", "- **Reads survive failures.**"),
            (
                ("system_hop_sigstop", (hop,)),
                ("node_forward", ()),
                ("forwarded_headers", ()),
            ),
            derived={
                "80": lambda j: (
                    j["forwarded_headers"]["proxy_kernel_us_per_request"]
                    / j["forwarded_headers"]["proxy_cpu_us_per_request"]
                ),
            },
            not_figures={"25": "the goal: within 25%", "1.5": "the goal: 1.5x"},
        ),
        Passage(
            "reads survive failures",
            readme_passage("- **Reads survive failures.**", "- **Staleness is bounded"),
            (
                _system("2_reads_survive_failures"),
                ("system_hop_sigstop", ("2_reads_survive_failures",)),
            ),
            not_figures={
                "9": "kill -9",
                "4": "active for 4 of 12 partitions",
                "50": "the goal: under 50 ms",
                "10": "10 s (settings)",
                "2": "the proxy's 2 s upstream timeout (a setting)",
            },
        ),
        Passage(
            "staleness, restart, freshness, long run",
            readme_passage("- **Staleness is bounded", "- **What the nodes cost.**"),
            (
                _system("3_staleness"),
                _system("4_restart_without_restore"),
                _system("5_freshness"),
                _system("soak"),
            ),
            derived={
                "186": lambda j: _node_memory_change(j, min),
                "51": lambda j: _node_memory_change(j, max),
            },
            not_figures={
                **cores,
                "16": "the 16 s budget (16000 ms in the JSON)",
                "500": "a budget and the trigger interval (settings)",
                "20": "writes/s (a setting)",
            },
        ),
        Passage(
            "what the nodes cost",
            readme_passage("- **What the nodes cost.**", "- **Slow nodes and read-your-writes**"),
            (_system("resources", "soak"), _system("soak", "rate")),
            not_figures={
                **cores,
                "7": "issue 7",
                "20": "20 writes/s and the consumers' 20 ms fetch wait (settings)",
            },
        ),
        Passage(
            "slow nodes",
            readme_passage("- **Slow nodes and read-your-writes**", "- **Soak with node kills**"),
            (("slow_nodes", ()),),
            not_figures={
                "19": "issue 19",
                "10": "10 s (a setting)",
                "2": "the proxy's 2 s upstream timeout (a setting)",
            },
        ),
        Passage(
            "soak",
            readme_passage("- **Soak with node kills**", None),
            (("soak", ()),),
            not_figures={"9": "kill -9", "2": "every 2 minutes (120 s in the JSON)"},
        ),
    ]


@pytest.mark.parametrize("passage", _readme_passages(), ids=lambda p: p.name)
def test_every_figure_readme_quotes_is_in_the_json_it_cites(passage: Passage):
    assert unmatched(passage) == [], f"README ({passage.name}): not in the JSON it cites"


def test_readme_figure_passages_cover_the_benchmarks_section():
    """A new paragraph in "Benchmarks" must be added above, so its figures are checked."""
    section = readme_passage("## Benchmarks", None)
    covered = "".join(p.text for p in _readme_passages())
    prose = _NOT_PROSE.sub(" ", section)
    for paragraph in re.split(r"\n\s*\n|\n(?=- )", prose):
        if figures_in(paragraph):
            head = paragraph.strip()[:60]
            assert head in _NOT_PROSE.sub(" ", covered), f"unchecked README passage: {head!r}"


# -- the matching rule itself -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quoted", "value", "shown"),
    [
        ("0.68", 0.68, True),
        ("0.69", 0.68, False),
        ("0.6", 0.6, True),
        ("28,620", 28620, True),
        ("28,600", 28620, False),  # exact unless marked ~
        ("~28,600", 28620, True),
        ("~89,000", 89255, True),
        ("~80", 74.1, False),
        ("~74", 74.1, True),
        ("0.5", 0.0053, True),  # 0.5%: a share
        ("1.35", 1.38, False),
    ],
)
def test_a_figure_is_shown_at_the_precision_it_is_written(quoted, value, shown):
    assert shown_as(quoted, value) is shown
