/*
 * The proxy's common case in C: one whole keyed GET or HEAD in one read, a cached replica
 * choice, an idle pooled connection, and one whole simple response in one read.
 *
 * Why: the same forwarding in Python costs several times the CPU per request of this path
 * (docs/architecture.md, D3, with the measurements), and most of it is Python calls per
 * parser callback, per header and per step. Here the connection protocols' data_received are C methods, so uvloop
 * calls straight into C, and nothing in the common case calls back into Python except the
 * key's partitioner (KeyPartitioner.partition_of, itself C for murmur2).
 *
 * The rule that keeps this safe: the C path either does everything the Python path would do,
 * byte for byte (tests/proxy/test_hotpath.py compares the two on generated requests, and
 * tests/proxy/test_hotpath_inprocess.py on every route kind and setting C serves), or it
 * does nothing at all and hands the same bytes to the Python path (`slow_data_received`),
 * which owns every other case: partial reads, pipelining, bodies, limits, errors, budgets by
 * header, percent-encoded keys, unknown stores, retry statuses (421 by default), 5xx while
 * they count towards ejection (proxy/outliers.py; the answers served here end a node's 5xx
 * streak through its Tally's `answered`), failover, timeouts, and hedging (the pool's sweeper
 * adopts a request still unanswered after the hedge delay). Parsing is llhttp, the parser
 * httptools (the Python path) is built on, vendored in proxy/_llhttp.
 *
 * The boundary with Python (docs/proxy-hotpath.md): what C is given is built once in Python
 * (proxy.hotpath_spec: HotRoute and HotStore, each saying whether C serves it; Candidate and
 * Cached from proxy.handler) and read by field name; what C calls is listed before the
 * interned names below; its one clock for times Python computed is shared_now_ms.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "llhttp.h"

#define MAX_SEGMENTS 32
#define MAX_FAST_HEADERS 64
#define MAX_RESPONSE_HEAD 65536
#define MAX_REQUEST_ID 64
#define LATENCY_BUCKETS 14
#define STATUS_SLOTS 600

/* proxy/metrics.py LATENCY_BUCKETS_S; Hub.latency_buckets() lets a test check they agree. */
static const double latency_bounds[LATENCY_BUCKETS] = {
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
};

/* A string literal and its length, counted by the compiler: put(&w, LIT("x: ")). */
#define LIT(s) (s), (sizeof(s) - 1)
/* The length of a string literal, for sizing what put(&w, LIT(s)) writes. */
#define LEN(s) (sizeof(s) - 1)

/* The pieces of the request head sent to nodes and of the answers written to clients, named
 * once: each is sized with LEN and written with LIT, so no length is counted by hand. */
#define HTTP11_LINE_END " HTTP/1.1\r\n"
#define HEADER_SEPARATOR ": "
#define CRLF "\r\n"
#define FORWARDED_FOR "x-forwarded-for: "
#define FORWARDED_FOR_JOIN ", "
#define FORWARDED_PROTO CRLF "x-forwarded-proto: http\r\n" /* also ends x-forwarded-for */
#define FORWARDED_HOST "x-forwarded-host: "
#define REQUEST_ID "x-request-id: "
#define KEEP_ALIVE_END CRLF
#define CLOSE_END "connection: close\r\n\r\n"

/* The C/Python contract, the Python side (docs/proxy-hotpath.md, "The C/Python boundary"). The
 * C path calls these methods and no others on Python objects: transport.write(bytes) on both
 * transports; slow_data_received(data) on either protocol (the Python path takes the bytes);
 * after_fast_response(keep_alive) on a client connection (proxy.listener); adopt() and
 * close_now() on a node connection (proxy.upstream); and the partitioners a HotStore names.
 * It reads the fields of proxy.hotpath_spec.HotRoute and HotStore in Hub.set_routes and
 * Hub.set_stores only, never while serving. */
static PyObject *str_write, *str_slow_data_received, *str_after_fast_response, *str_close_now,
    *str_adopt;

/* Monotonic seconds: deadlines and latency only, never compared with a shared-clock time. */
static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* This host's wall clock, read only through shared_now_ms. */
static long long wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- Tally: a counter the Python metrics read at scrape time ------------------------------ */

typedef struct {
    PyObject_HEAD
    long long value;
    long long answered; /* node tallies: answers below 500 (proxy/outliers.py ends 5xx streaks) */
} Tally;

static PyMemberDef Tally_members[] = {
    {"value", T_LONGLONG, offsetof(Tally, value), 0, "count so far"},
    {"answered", T_LONGLONG, offsetof(Tally, answered), 0,
     "a node's answers below 500 (both paths): a 5xx streak ends when it moves"},
    {NULL},
};

static PyTypeObject TallyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.Tally",
    .tp_basicsize = sizeof(Tally),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_members = Tally_members,
    .tp_doc = "A counter kept in C, read by the metrics collector.",
};

/* ---- ReportClock: how far one node's report times moved since its rows were built -------- */

/* proxy.choice.ReportClock. A node that confirms an unchanged report later moves every time in
 * it by the same amount; its replicas, the candidates made of them and the cached choices'
 * expiries read their times through this one number, so a confirmation is one write. */
typedef struct {
    PyObject_HEAD
    long long shift_ms;
} ReportClock;

static int ReportClock_init(ReportClock *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"shift_ms", NULL};
    long long shift_ms = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L", names, &shift_ms)) return -1;
    self->shift_ms = shift_ms;
    return 0;
}

static PyObject *ReportClock_repr(ReportClock *self) {
    return PyUnicode_FromFormat("ReportClock(shift_ms=%lld)", self->shift_ms);
}

static PyMemberDef ReportClock_members[] = {
    {"shift_ms", T_LONGLONG, offsetof(ReportClock, shift_ms), 0,
     "ms every report time of the node moved since its rows were built"},
    {NULL},
};

static PyTypeObject ReportClockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.ReportClock",
    .tp_basicsize = sizeof(ReportClock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ReportClock_init,
    .tp_repr = (reprfunc)ReportClock_repr,
    .tp_members = ReportClock_members,
    .tp_doc = "How far one node's report times moved since the table built its rows.",
};

/* ---- Candidate: one replica to try, with what answering from it needs --------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *target;       /* proxy.exchange.Target */
    PyObject *replica;      /* proxy.choice.Replica or None */
    PyObject *provenance;   /* bytes: x-kroute-* lines for answers from it */
    PyObject *idle;         /* list: the pool's idle connections to this node */
    PyObject *host_line;    /* bytes: "host: authority\r\n" */
    PyObject *choice_tally; /* Tally or None */
    PyObject *node_tally;   /* Tally */
    long long lag;          /* offsets behind; -1 when unknown */
    long long caught_up_at_ms; /* as given, before `clock`; -1 when unknown */
    PyObject *clock;        /* ReportClock the time reads through, or NULL */
} Candidate;

static int Candidate_init(Candidate *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"target",     "replica", "provenance",      "idle",  "host_line",
                            "choice_tally", "node_tally", "lag", "caught_up_at_ms", "clock",
                            NULL};
    PyObject *target, *replica, *provenance, *idle, *host_line, *choice_tally, *node_tally;
    PyObject *clock = Py_None;
    long long lag = -1, caught_up_at_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOSO!SOO!|LLO", names, &target, &replica,
                                     &provenance, &PyList_Type, &idle, &host_line, &choice_tally,
                                     &TallyType, &node_tally, &lag, &caught_up_at_ms, &clock))
        return -1;
    if (choice_tally != Py_None && !PyObject_TypeCheck(choice_tally, &TallyType)) {
        PyErr_SetString(PyExc_TypeError, "choice_tally must be a Tally or None");
        return -1;
    }
    if (clock != Py_None && !PyObject_TypeCheck(clock, &ReportClockType)) {
        PyErr_SetString(PyExc_TypeError, "clock must be a ReportClock or None");
        return -1;
    }
    Py_XSETREF(self->clock, clock == Py_None ? NULL : Py_NewRef(clock));
    Py_XSETREF(self->target, Py_NewRef(target));
    Py_XSETREF(self->replica, Py_NewRef(replica));
    Py_XSETREF(self->provenance, Py_NewRef(provenance));
    Py_XSETREF(self->idle, Py_NewRef(idle));
    Py_XSETREF(self->host_line, Py_NewRef(host_line));
    Py_XSETREF(self->choice_tally, Py_NewRef(choice_tally));
    Py_XSETREF(self->node_tally, Py_NewRef(node_tally));
    self->lag = lag;
    self->caught_up_at_ms = caught_up_at_ms;
    return 0;
}

static int Candidate_traverse(Candidate *self, visitproc visit, void *arg) {
    Py_VISIT(self->target);
    Py_VISIT(self->replica);
    Py_VISIT(self->idle);
    return 0;
}

static int Candidate_clear(Candidate *self) {
    Py_CLEAR(self->target);
    Py_CLEAR(self->replica);
    Py_CLEAR(self->provenance);
    Py_CLEAR(self->idle);
    Py_CLEAR(self->host_line);
    Py_CLEAR(self->choice_tally);
    Py_CLEAR(self->node_tally);
    Py_CLEAR(self->clock);
    return 0;
}

/* The candidate's caught-up time as it reads now (its clock applied); -1 when unknown. */
static inline long long candidate_caught_up_at(const Candidate *candidate) {
    if (candidate->caught_up_at_ms < 0) return -1;
    if (candidate->clock == NULL) return candidate->caught_up_at_ms;
    return candidate->caught_up_at_ms + ((ReportClock *)candidate->clock)->shift_ms;
}

static PyObject *Candidate_get_caught_up_at_ms(Candidate *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(candidate_caught_up_at(self));
}

static PyGetSetDef Candidate_getset[] = {
    {"caught_up_at_ms", (getter)Candidate_get_caught_up_at_ms, NULL,
     "caught up at, as it reads now through the clock; -1 when unknown", NULL},
    {NULL},
};

static void Candidate_dealloc(Candidate *self) {
    PyObject_GC_UnTrack(self);
    Candidate_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Candidate_members[] = {
    {"target", T_OBJECT, offsetof(Candidate, target), READONLY, NULL},
    {"replica", T_OBJECT, offsetof(Candidate, replica), READONLY, NULL},
    {"provenance", T_OBJECT, offsetof(Candidate, provenance), READONLY, NULL},
    {"idle", T_OBJECT, offsetof(Candidate, idle), READONLY, NULL},
    {"choice_tally", T_OBJECT, offsetof(Candidate, choice_tally), READONLY, NULL},
    {"node_tally", T_OBJECT, offsetof(Candidate, node_tally), READONLY, NULL},
    {"clock", T_OBJECT, offsetof(Candidate, clock), READONLY, NULL},
    {NULL},
};

static PyTypeObject CandidateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.Candidate",
    .tp_basicsize = sizeof(Candidate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Candidate_init,
    .tp_traverse = (traverseproc)Candidate_traverse,
    .tp_clear = (inquiry)Candidate_clear,
    .tp_dealloc = (destructor)Candidate_dealloc,
    .tp_members = Candidate_members,
    .tp_getset = Candidate_getset,
    .tp_doc = "A replica to send to: its node, how to reach it, what to say about it.",
};

/* ---- Cached: the replica order for one (store, partition) until it may change ------------- */

typedef struct {
    PyObject_HEAD
    PyObject *choice;     /* proxy.choice.Choice (its rejections go into 503 bodies) */
    PyObject *candidates; /* tuple of Candidate, best first */
    long long expires_ms; /* wall-clock ms from which it must be checked again */
    /* What the expiry is the earliest of (proxy.choice.expiry_terms): `cap_ms`, and for each
     * (clock, base) pair of `terms`, base + the clock's shift. A node's confirmation moves its
     * clock, so the moment a choice stops being exact moves with it, with nothing renewed:
     * when `expires_ms` comes, it is computed again from the clocks (cached_recheck). */
    long long cap_ms;
    PyObject *terms;  /* tuple of (ReportClock, int) */
    int spread_width; /* reads rotate over this many first candidates (choice.rotated) */
} Cached;

/* Whether terms is a tuple of (ReportClock, int) pairs whose ints fit a long long. */
static int valid_terms(PyObject *terms) {
    if (!PyTuple_Check(terms)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(terms); i++) {
        PyObject *term = PyTuple_GET_ITEM(terms, i);
        if (!PyTuple_Check(term) || PyTuple_GET_SIZE(term) != 2 ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(term, 0), &ReportClockType) ||
            !PyLong_Check(PyTuple_GET_ITEM(term, 1)))
            return 0;
        long long base = PyLong_AsLongLong(PyTuple_GET_ITEM(term, 1));
        if (base == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static int Cached_init(Cached *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"choice", "candidates", "expires_ms", "spread_width",
                            "terms",  "cap_ms",     NULL};
    PyObject *choice, *candidates, *terms = NULL, *cap = Py_None;
    long long expires_ms;
    int spread_width = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!L|iOO", names, &choice, &PyTuple_Type,
                                     &candidates, &expires_ms, &spread_width, &terms, &cap))
        return -1;
    if (spread_width < 1 || spread_width > PyTuple_GET_SIZE(candidates)) spread_width = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(candidates); i++) {
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(candidates, i), &CandidateType)) {
            PyErr_SetString(PyExc_TypeError, "candidates must be Candidate objects");
            return -1;
        }
    }
    if (terms != NULL && !valid_terms(terms)) {
        PyErr_SetString(PyExc_TypeError, "terms must be a tuple of (ReportClock, int) pairs");
        return -1;
    }
    long long cap_ms = expires_ms;
    if (cap != Py_None) {
        cap_ms = PyLong_AsLongLong(cap);
        if (cap_ms == -1 && PyErr_Occurred()) return -1;
    }
    Py_XSETREF(self->choice, Py_NewRef(choice));
    Py_XSETREF(self->candidates, Py_NewRef(candidates));
    Py_XSETREF(self->terms, terms == NULL ? PyTuple_New(0) : Py_NewRef(terms));
    if (self->terms == NULL) return -1;
    self->expires_ms = expires_ms;
    self->cap_ms = cap_ms;
    self->spread_width = spread_width;
    return 0;
}

/* The expiry computed again from the clocks as they read now (never earlier than it was):
 * clocks only move later, and only when no choice changes by it. */
static void cached_recheck(Cached *self) {
    PyObject *terms = self->terms;
    if (terms == NULL) return; /* made by __new__ alone, or cleared by the collector */
    long long expires = self->cap_ms;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(terms); i++) {
        PyObject *term = PyTuple_GET_ITEM(terms, i);
        long long base = PyLong_AsLongLong(PyTuple_GET_ITEM(term, 1)); /* checked by init */
        long long at = base + ((ReportClock *)PyTuple_GET_ITEM(term, 0))->shift_ms;
        if (at < expires) expires = at;
    }
    if (expires > self->expires_ms) self->expires_ms = expires;
}

/* Whether the choice is still exact at now_ms: its expiry checked again when it has come. */
static inline int cached_live(Cached *self, long long now_ms) {
    if (now_ms < self->expires_ms) return 1;
    cached_recheck(self);
    return now_ms < self->expires_ms;
}

static int Cached_traverse(Cached *self, visitproc visit, void *arg) {
    Py_VISIT(self->choice);
    Py_VISIT(self->candidates);
    Py_VISIT(self->terms);
    return 0;
}

static int Cached_clear(Cached *self) {
    Py_CLEAR(self->choice);
    Py_CLEAR(self->candidates);
    Py_CLEAR(self->terms);
    return 0;
}

static void Cached_dealloc(Cached *self) {
    PyObject_GC_UnTrack(self);
    Cached_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Cached_live(Cached *self, PyObject *arg) {
    long long now_ms = PyLong_AsLongLong(arg);
    if (now_ms == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(cached_live(self, now_ms));
}

static PyMethodDef Cached_methods[] = {
    {"live", (PyCFunction)Cached_live, METH_O,
     "Whether the choice is still exact at now_ms (its expiry computed again from its "
     "replicas' clocks once it has come)."},
    {NULL},
};

static PyMemberDef Cached_members[] = {
    {"choice", T_OBJECT, offsetof(Cached, choice), READONLY, NULL},
    {"candidates", T_OBJECT, offsetof(Cached, candidates), READONLY, NULL},
    {"expires_ms", T_LONGLONG, offsetof(Cached, expires_ms), READONLY, NULL},
    {"cap_ms", T_LONGLONG, offsetof(Cached, cap_ms), READONLY, NULL},
    {"terms", T_OBJECT, offsetof(Cached, terms), READONLY, NULL},
    {"spread_width", T_INT, offsetof(Cached, spread_width), READONLY, NULL},
    {NULL},
};

static PyTypeObject CachedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.Cached",
    .tp_basicsize = sizeof(Cached),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Cached_init,
    .tp_traverse = (traverseproc)Cached_traverse,
    .tp_clear = (inquiry)Cached_clear,
    .tp_dealloc = (destructor)Cached_dealloc,
    .tp_members = Cached_members,
    .tp_methods = Cached_methods,
    .tp_doc = "A replica choice with the moment it stops being exact.",
};

/* ---- Hub: routes, stores and counters shared by every connection -------------------------- */

/* Where a key comes from; proxy.hotpath_spec.C_KEY_SOURCES maps the route settings to these. */
enum { KEY_PATH = 0, KEY_QUERY = 1, KEY_HEADER = 2, KEY_SOURCE_COUNT };

typedef struct {
    int c_serves;                   /* 0: a request this route may match goes to Python */
    int segments;                   /* path segments of the template */
    int literals;
    int literal_index[MAX_SEGMENTS];
    PyObject *literal[MAX_SEGMENTS]; /* bytes */
    int key_source;
    int key_index;
    PyObject *key_name;    /* bytes: query parameter or lower-case header name */
    int store_index;       /* -1: the route names its store */
    PyObject *fixed_store; /* bytes or NULL */
} Route;

typedef struct {
    int c_serves;           /* 0: requests for this store go to Python */
    PyObject *name;         /* bytes */
    PyObject *partitioners; /* tuple: per route index, the key -> partition callable */
    PyObject *cache;        /* list: per partition, Cached or None */
} Store;

typedef struct Hub Hub;

struct Hub {
    PyObject_HEAD
    int enabled;
    int draining; /* the proxy is stopping: every answer says connection: close */
    int spread;
    Route *routes;
    int route_count;
    Store *stores;
    int store_count;
    PyObject *status_line[STATUS_SLOTS]; /* bytes per status, NULL: not sent from C */
    /* Lower-case header names, from proxy/http.py and proxy/handler.py (one owner each): */
    PyObject *request_drop;  /* tuple: never passed on to nodes */
    PyObject *response_drop; /* tuple: never passed on to clients */
    PyObject *python_only;   /* tuple: a request with one goes the Python way */
    PyObject *request_lines; /* bytes: header lines added to every request to a node (the lag
                              * budget the node enforces; proxy.freshness.node_budget_lines) */
    char id_prefix[24];
    int id_prefix_length;
    unsigned long long id_counter;
    unsigned long long spread_counter;
    double response_timeout_s;
    double idle_timeout_s;
    long long max_response_bytes;
    Py_ssize_t max_request_bytes;
    int max_headers;
    Py_ssize_t idle_per_origin;
    long long clock_offset_ms; /* added to the wall clock: the shared (Redis) time, see
                                * common.clock; set by the handler on every table refresh */
    long long in_flight;
    long long deposits;
    long long forwarded;
    long long status_counts[STATUS_SLOTS];
    long long latency_counts[LATENCY_BUCKETS + 1];
    double latency_sum;
};

/* The shared clock, the same as common.clock.SHARED.now_ms() (Redis time once synced): this
 * host's wall clock plus the offset Python sets on every table refresh (Hub.clock_offset_ms, set
 * by proxy.hotpath_spec.sync_clock from RequestHandler.use_snapshot). Every time C compares with
 * a time Python computed (a choice's expiry, a replica's caught-up time) is read here. */
static long long shared_now_ms(const Hub *hub) { return wall_ms() + hub->clock_offset_ms; }

static void free_route_array(Route *routes, int count) {
    for (int r = 0; r < count; r++) {
        Route *route = &routes[r];
        for (int i = 0; i < route->literals; i++) Py_XDECREF(route->literal[i]);
        Py_XDECREF(route->key_name);
        Py_XDECREF(route->fixed_store);
    }
    PyMem_Free(routes);
}

static void free_routes(Hub *hub) {
    free_route_array(hub->routes, hub->route_count);
    hub->routes = NULL;
    hub->route_count = 0;
}

static void free_store_array(Store *stores, int count) {
    for (int s = 0; s < count; s++) {
        Py_XDECREF(stores[s].name);
        Py_XDECREF(stores[s].partitioners);
        Py_XDECREF(stores[s].cache);
    }
    PyMem_Free(stores);
}

static void free_stores(Hub *hub) {
    free_store_array(hub->stores, hub->store_count);
    hub->stores = NULL;
    hub->store_count = 0;
}

static int all_bytes(PyObject *names) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(names, i))) {
            PyErr_SetString(PyExc_TypeError, "header names must be bytes");
            return 0;
        }
    }
    return 1;
}

static int Hub_init(Hub *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"status_lines", "request_drop", "response_drop", "python_only",
                            "id_prefix", "response_timeout_s", "idle_timeout_s",
                            "max_response_bytes", "max_request_bytes", "max_headers",
                            "idle_per_origin", "spread", NULL};
    PyObject *status_lines, *request_drop, *response_drop, *python_only;
    const char *prefix;
    Py_ssize_t prefix_length;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!y#ddLnini", names, &PyDict_Type,
                                     &status_lines, &PyTuple_Type, &request_drop, &PyTuple_Type,
                                     &response_drop, &PyTuple_Type, &python_only, &prefix,
                                     &prefix_length, &self->response_timeout_s,
                                     &self->idle_timeout_s, &self->max_response_bytes,
                                     &self->max_request_bytes, &self->max_headers,
                                     &self->idle_per_origin, &self->spread))
        return -1;
    if (!all_bytes(request_drop) || !all_bytes(response_drop) || !all_bytes(python_only))
        return -1;
    Py_XSETREF(self->request_drop, Py_NewRef(request_drop));
    Py_XSETREF(self->response_drop, Py_NewRef(response_drop));
    Py_XSETREF(self->python_only, Py_NewRef(python_only));
    if (prefix_length > 16) {
        PyErr_SetString(PyExc_ValueError, "id_prefix is at most 16 bytes");
        return -1;
    }
    memcpy(self->id_prefix, prefix, prefix_length);
    self->id_prefix[prefix_length] = '-';
    self->id_prefix_length = (int)prefix_length + 1;
    PyObject *status, *line;
    Py_ssize_t position = 0;
    while (PyDict_Next(status_lines, &position, &status, &line)) {
        long code = PyLong_AsLong(status);
        if (code == -1 && PyErr_Occurred()) return -1;
        if (code < 0 || code >= STATUS_SLOTS || !PyBytes_Check(line)) {
            PyErr_SetString(PyExc_ValueError, "status_lines maps statuses below 600 to bytes");
            return -1;
        }
        Py_XSETREF(self->status_line[code], Py_NewRef(line));
    }
    Py_XSETREF(self->request_lines, PyBytes_FromStringAndSize(NULL, 0));
    if (self->request_lines == NULL) return -1;
    self->enabled = 1;
    return 0;
}

static void Hub_dealloc(Hub *self) {
    free_routes(self);
    free_stores(self);
    for (int status = 0; status < STATUS_SLOTS; status++) Py_XDECREF(self->status_line[status]);
    Py_XDECREF(self->request_drop);
    Py_XDECREF(self->response_drop);
    Py_XDECREF(self->python_only);
    Py_XDECREF(self->request_lines);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- Reading proxy.hotpath_spec's structures, by field name (set_routes, set_stores) ------- */

/* spec.<name> as a new reference, or NULL with a TypeError naming the structure and field. */
static PyObject *spec_field(PyObject *spec, const char *kind, const char *name) {
    PyObject *value = PyObject_GetAttrString(spec, name);
    if (value == NULL)
        PyErr_Format(PyExc_TypeError, "%s has no field %s (see proxy.hotpath_spec)", kind, name);
    return value;
}

/* A field that must be of `type` (checked with PyObject_TypeCheck), or NULL and a TypeError. */
static PyObject *typed_field(PyObject *spec, const char *kind, const char *name,
                             PyTypeObject *type) {
    PyObject *value = spec_field(spec, kind, name);
    if (value != NULL && !PyObject_TypeCheck(value, type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s must be %s, not %s", kind, name, type->tp_name,
                     Py_TYPE(value)->tp_name);
        Py_CLEAR(value);
    }
    return value;
}

static int int_field(PyObject *spec, const char *kind, const char *name, int *out) {
    PyObject *value = typed_field(spec, kind, name, &PyLong_Type);
    if (value == NULL) return -1;
    long number = PyLong_AsLong(value);
    Py_DECREF(value);
    if (number == -1 && PyErr_Occurred()) return -1;
    if (number < -1 || number > 1 << 20) {
        PyErr_Format(PyExc_ValueError, "%s.%s is out of range", kind, name);
        return -1;
    }
    *out = (int)number;
    return 0;
}

static int bool_field(PyObject *spec, const char *kind, const char *name, int *out) {
    PyObject *value = typed_field(spec, kind, name, &PyBool_Type);
    if (value == NULL) return -1;
    *out = value == Py_True;
    Py_DECREF(value);
    return 0;
}

/* The template's literal segments ((index, bytes), ...) into the route; -1 with an error. */
static int read_literals(Route *route, PyObject *literals) {
    if (PyTuple_GET_SIZE(literals) > MAX_SEGMENTS) {
        PyErr_SetString(PyExc_ValueError, "HotRoute.literals: more than MAX_SEGMENTS");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(literals); i++) {
        int index;
        PyObject *text;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(literals, i), "iS;HotRoute.literals holds "
                              "(segment index, bytes) pairs", &index, &text))
            return -1;
        if (index < 0 || index >= route->segments) {
            PyErr_SetString(PyExc_ValueError, "literal index outside the template");
            return -1;
        }
        route->literal_index[i] = index;
        route->literal[i] = Py_NewRef(text);
        route->literals = (int)i + 1;
    }
    return 0;
}

static int read_route_literals(Route *route, PyObject *spec) {
    PyObject *literals = typed_field(spec, "HotRoute", "literals", &PyTuple_Type);
    if (literals == NULL) return -1;
    int read = read_literals(route, literals);
    Py_DECREF(literals);
    return read;
}

/* One proxy.hotpath_spec.HotRoute. A route C does not serve needs its segments and literals. */
static int read_route(Route *route, PyObject *spec) {
    const char *kind = "HotRoute";
    if (bool_field(spec, kind, "c_serves", &route->c_serves) < 0 ||
        int_field(spec, kind, "segments", &route->segments) < 0)
        return -1;
    if (!route->c_serves) {
        /* Its literals only, to tell whether a request may be this route's (a template longer
         * than MAX_SEGMENTS matches no request C reads: nothing more is needed). */
        if (route->segments > MAX_SEGMENTS) return 0;
        return read_route_literals(route, spec);
    }
    if (int_field(spec, kind, "key_source", &route->key_source) < 0 ||
        int_field(spec, kind, "key_index", &route->key_index) < 0 ||
        int_field(spec, kind, "store_index", &route->store_index) < 0)
        return -1;
    route->key_name = typed_field(spec, kind, "key_name", &PyBytes_Type);
    if (route->key_name == NULL) return -1;
    PyObject *fixed_store = spec_field(spec, kind, "fixed_store");
    if (fixed_store == NULL) return -1;
    if (fixed_store == Py_None) {
        Py_DECREF(fixed_store);
    } else if (!PyBytes_Check(fixed_store)) {
        Py_DECREF(fixed_store);
        PyErr_SetString(PyExc_TypeError, "HotRoute.fixed_store must be bytes or None");
        return -1;
    } else {
        route->fixed_store = fixed_store;
    }
    int valid = route->segments <= MAX_SEGMENTS && route->key_source >= 0 &&
                route->key_source < KEY_SOURCE_COUNT && route->store_index < route->segments &&
                (route->store_index >= 0 || route->fixed_store != NULL) &&
                (route->key_source != KEY_PATH ||
                 (route->key_index >= 0 && route->key_index < route->segments));
    if (!valid) {
        PyErr_SetString(PyExc_ValueError, "inconsistent route");
        return -1;
    }
    return read_route_literals(route, spec);
}

/* set_routes([HotRoute, ...]) in the order routes are tried. The new table is read whole
 * before it replaces the old one: on any error the hub keeps serving the old table (a half-read
 * route, say one whose literals are missing, would match requests that are not its own). The
 * list is copied first, so an object that changes it while its fields are read cannot move
 * the reading out of bounds. */
static PyObject *Hub_set_routes(Hub *self, PyObject *specs) {
    if (!PyList_Check(specs)) {
        PyErr_SetString(PyExc_TypeError, "routes must be a list of HotRoute");
        return NULL;
    }
    PyObject *items = PyList_AsTuple(specs);
    if (items == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(items);
    Route *routes = count > INT_MAX ? NULL : PyMem_Calloc(count ? count : 1, sizeof(Route));
    if (routes == NULL) {
        Py_DECREF(items);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t r = 0; r < count; r++) {
        if (read_route(&routes[r], PyTuple_GET_ITEM(items, r)) < 0) {
            free_route_array(routes, (int)r + 1);
            Py_DECREF(items);
            return NULL;
        }
    }
    Py_DECREF(items);
    free_routes(self);
    self->routes = routes;
    self->route_count = (int)count;
    Py_RETURN_NONE;
}

/* One proxy.hotpath_spec.HotStore; its cache list is shared with Python. */
static int read_store(Store *store, PyObject *spec) {
    const char *kind = "HotStore";
    if (bool_field(spec, kind, "c_serves", &store->c_serves) < 0) return -1;
    store->name = typed_field(spec, kind, "name", &PyBytes_Type);
    if (store->name == NULL) return -1;
    store->partitioners = typed_field(spec, kind, "partitioners", &PyTuple_Type);
    if (store->partitioners == NULL) return -1;
    store->cache = typed_field(spec, kind, "cache", &PyList_Type);
    return store->cache == NULL ? -1 : 0;
}

/* set_stores([HotStore, ...]), read whole before it replaces the old table, as set_routes is:
 * on any error the hub keeps the old one (a half-read store has no partitioners or cache). */
static PyObject *Hub_set_stores(Hub *self, PyObject *specs) {
    if (!PyList_Check(specs)) {
        PyErr_SetString(PyExc_TypeError, "stores must be a list of HotStore");
        return NULL;
    }
    PyObject *items = PyList_AsTuple(specs);
    if (items == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(items);
    Store *stores = count > INT_MAX ? NULL : PyMem_Calloc(count ? count : 1, sizeof(Store));
    if (stores == NULL) {
        Py_DECREF(items);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t s = 0; s < count; s++) {
        if (read_store(&stores[s], PyTuple_GET_ITEM(items, s)) < 0) {
            free_store_array(stores, (int)s + 1);
            Py_DECREF(items);
            return NULL;
        }
    }
    Py_DECREF(items);
    free_stores(self);
    self->stores = stores;
    self->store_count = (int)count;
    Py_RETURN_NONE;
}

static Py_ssize_t format_request_id(Hub *hub, char *out) {
    memcpy(out, hub->id_prefix, hub->id_prefix_length);
    return hub->id_prefix_length +
           sprintf(out + hub->id_prefix_length, "%llx", ++hub->id_counter);
}

static PyObject *Hub_next_request_id(Hub *self, PyObject *unused) {
    char buffer[48];
    Py_ssize_t length = format_request_id(self, buffer);
    return PyBytes_FromStringAndSize(buffer, length);
}

static PyObject *Hub_take_deposits(Hub *self, PyObject *unused) {
    long long deposits = self->deposits;
    self->deposits = 0;
    return PyLong_FromLongLong(deposits);
}

static PyObject *Hub_stats(Hub *self, PyObject *unused) {
    PyObject *statuses = PyDict_New(), *latency = PyList_New(LATENCY_BUCKETS + 1);
    if (statuses == NULL || latency == NULL) goto error;
    for (int status = 0; status < STATUS_SLOTS; status++) {
        if (self->status_counts[status] == 0) continue;
        PyObject *key = PyLong_FromLong(status);
        PyObject *value = PyLong_FromLongLong(self->status_counts[status]);
        int failed = key == NULL || value == NULL || PyDict_SetItem(statuses, key, value) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (failed) goto error;
    }
    for (int i = 0; i <= LATENCY_BUCKETS; i++) {
        PyObject *value = PyLong_FromLongLong(self->latency_counts[i]);
        if (value == NULL) goto error;
        PyList_SET_ITEM(latency, i, value);
    }
    return Py_BuildValue("{sNsNsdsLsL}", "responses", statuses, "latency_counts", latency,
                         "latency_sum_s", self->latency_sum, "forwarded", self->forwarded,
                         "in_flight", self->in_flight);
error:
    Py_XDECREF(statuses);
    Py_XDECREF(latency);
    return NULL;
}

static PyObject *Hub_latency_buckets(Hub *self, PyObject *unused) {
    PyObject *bounds = PyTuple_New(LATENCY_BUCKETS);
    if (bounds == NULL) return NULL;
    for (int i = 0; i < LATENCY_BUCKETS; i++)
        PyTuple_SET_ITEM(bounds, i, PyFloat_FromDouble(latency_bounds[i]));
    return bounds;
}

static PyMethodDef Hub_methods[] = {
    {"set_routes", (PyCFunction)Hub_set_routes, METH_O, "Keyed routes, in matching order."},
    {"set_stores", (PyCFunction)Hub_set_stores, METH_O, "Stores with partitioners and caches."},
    {"next_request_id", (PyCFunction)Hub_next_request_id, METH_NOARGS, "A fresh request id."},
    {"take_deposits", (PyCFunction)Hub_take_deposits, METH_NOARGS,
     "Requests forwarded in C since the last call (retry-budget deposits)."},
    {"stats", (PyCFunction)Hub_stats, METH_NOARGS, "Counters of the C path."},
    {"latency_buckets", (PyCFunction)Hub_latency_buckets, METH_NOARGS, "Histogram bounds."},
    {NULL},
};

static PyMemberDef Hub_members[] = {
    {"enabled", T_INT, offsetof(Hub, enabled), 0, "0 sends every request the Python way"},
    {"draining", T_INT, offsetof(Hub, draining), 0,
     "1 while the proxy stops: answers in flight end their connection (connection: close)"},
    {"in_flight", T_LONGLONG, offsetof(Hub, in_flight), 0, "C-path requests awaiting a node"},
    {"clock_offset_ms", T_LONGLONG, offsetof(Hub, clock_offset_ms), 0,
     "added to the wall clock to read the shared (Redis) time"},
    {NULL},
};

static PyObject *Hub_get_request_lines(Hub *self, void *closure) {
    (void)closure;
    if (self->request_lines == NULL) return PyBytes_FromStringAndSize(NULL, 0);
    return Py_NewRef(self->request_lines);
}

static int Hub_set_request_lines(Hub *self, PyObject *value, void *closure) {
    (void)closure;
    if (value == NULL || !PyBytes_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "request_lines must be bytes");
        return -1;
    }
    Py_XSETREF(self->request_lines, Py_NewRef(value));
    return 0;
}

static PyGetSetDef Hub_getset[] = {
    {"request_lines", (getter)Hub_get_request_lines, (setter)Hub_set_request_lines,
     "header lines (bytes, each ending CRLF) added to every request sent to a node", NULL},
    {NULL},
};

static PyTypeObject HubType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.Hub",
    .tp_basicsize = sizeof(Hub),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hub_init,
    .tp_dealloc = (destructor)Hub_dealloc,
    .tp_methods = Hub_methods,
    .tp_members = Hub_members,
    .tp_getset = Hub_getset,
    .tp_doc = "What the C path shares: routes, stores, ids and counters.",
};

/* ---- Parsing one whole message with llhttp ------------------------------------------------ */

typedef struct {
    const char *name;
    size_t name_length;
    const char *value;
    size_t value_length;
} Header;

typedef struct {
    const char *url;
    size_t url_length;
    Header headers[MAX_FAST_HEADERS];
    int header_count;
    int field_open;
    int unusable; /* something the C path leaves to Python */
    const char *body;
    size_t body_length;
    int complete;
} Message;

static int extend_span(const char **start, size_t *length, const char *at, size_t more) {
    if (*start == NULL) {
        *start = at;
        *length = more;
        return 0;
    }
    if (*start + *length != at) return -1; /* not contiguous: cannot happen in one buffer */
    *length += more;
    return 0;
}

static int on_url(llhttp_t *parser, const char *at, size_t length) {
    Message *m = parser->data;
    if (extend_span(&m->url, &m->url_length, at, length) < 0) m->unusable = 1;
    return 0;
}

static int on_header_field(llhttp_t *parser, const char *at, size_t length) {
    Message *m = parser->data;
    if (m->field_open) { /* the same name, continued */
        m->headers[m->header_count - 1].name_length += length;
        return 0;
    }
    if (m->header_count == MAX_FAST_HEADERS) {
        m->unusable = 1;
        return HPE_PAUSED;
    }
    Header *h = &m->headers[m->header_count++];
    h->name = at;
    h->name_length = length;
    h->value = NULL;
    h->value_length = 0;
    m->field_open = 1;
    return 0;
}

static int on_header_field_complete(llhttp_t *parser) {
    ((Message *)parser->data)->field_open = 0;
    return 0;
}

static int on_header_value(llhttp_t *parser, const char *at, size_t length) {
    Message *m = parser->data;
    Header *h = &m->headers[m->header_count - 1];
    if (extend_span(&h->value, &h->value_length, at, length) < 0) m->unusable = 1;
    return 0;
}

static int on_body(llhttp_t *parser, const char *at, size_t length) {
    Message *m = parser->data;
    if (extend_span(&m->body, &m->body_length, at, length) < 0) m->unusable = 1;
    return 0;
}

static int on_message_complete(llhttp_t *parser) {
    ((Message *)parser->data)->complete = 1;
    return HPE_PAUSED; /* stop here: bytes after the first message belong to Python */
}

static llhttp_settings_t message_settings;

/* Parses data as exactly one whole message; 1 when it is, 0 otherwise. */
static int parse_whole(llhttp_t *parser, llhttp_type_t type, Message *m, const char *data,
                       Py_ssize_t length) {
    memset(m, 0, offsetof(Message, headers));
    m->header_count = 0;
    m->field_open = 0;
    m->unusable = 0;
    m->body = NULL;
    m->body_length = 0;
    m->complete = 0;
    llhttp_init(parser, type, &message_settings);
    parser->data = m;
    llhttp_errno_t error = llhttp_execute(parser, data, (size_t)length);
    if (error != HPE_PAUSED || !m->complete || m->unusable) return 0;
    return llhttp_get_error_pos(parser) == data + length;
}

/* ---- Small byte helpers ------------------------------------------------------------------- */

static int equals_lower_n(const char *text, size_t length, const char *lower, size_t n) {
    if (n != length) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = text[i];
        if (c >= 'A' && c <= 'Z') c = (char)(c + 32);
        if (c != lower[i]) return 0;
    }
    return 1;
}

/* For literals (strlen folds to a constant). */
static int equals_lower(const char *text, size_t length, const char *lower) {
    return equals_lower_n(text, length, lower, strlen(lower));
}

static int equals_bytes(const char *text, size_t length, PyObject *bytes) {
    return (Py_ssize_t)length == PyBytes_GET_SIZE(bytes) &&
           memcmp(text, PyBytes_AS_STRING(bytes), length) == 0;
}

/* Lower-case names compared as the Python path lower-cases them. */
static int header_is(const Header *h, const char *lower) {
    return equals_lower(h->name, h->name_length, lower);
}

static int header_in(const Header *h, PyObject *names) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (equals_lower_n(h->name, h->name_length, PyBytes_AS_STRING(name),
                           (size_t)PyBytes_GET_SIZE(name)))
            return 1;
    }
    return 0;
}

/* A request header copied to the node as it came (name lower-cased, as the Python path). */
static int passed_on(Hub *hub, const Header *h) {
    return !header_is(h, "x-request-id") && !header_in(h, hub->request_drop);
}

/* A Connection value the C path can treat as hop-by-hop only: "keep-alive" and "close"
 * tokens; any other token names a header to drop, which the Python path handles. */
static int plain_connection_value(const char *value, size_t length) {
    size_t i = 0;
    while (i < length) {
        while (i < length && (value[i] == ' ' || value[i] == '\t' || value[i] == ',')) i++;
        size_t start = i;
        while (i < length && value[i] != ',') i++;
        size_t end = i;
        while (end > start && (value[end - 1] == ' ' || value[end - 1] == '\t')) end--;
        if (end > start && !equals_lower(value + start, end - start, "keep-alive") &&
            !equals_lower(value + start, end - start, "close"))
            return 0;
    }
    return 1;
}

/* ^[A-Za-z0-9._:-]{1,64}$, as listener._VALID_REQUEST_ID */
static int valid_request_id(const char *value, size_t length) {
    if (length < 1 || length > MAX_REQUEST_ID) return 0;
    for (size_t i = 0; i < length; i++) {
        char c = value[i];
        int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == ':' || c == '-';
        if (!ok) return 0;
    }
    return 1;
}

/* Path bytes taken without decoding: RFC 3986 pchar minus '%', plus '/'. */
static int plain_path_byte(unsigned char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           strchr("-._~!$&'()*+,;=:@/", c) != NULL;
}

static int printable_ascii(const char *text, size_t length) {
    for (size_t i = 0; i < length; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c < 0x20 || c > 0x7e) return 0;
    }
    return 1;
}

typedef struct {
    char *p;
} Writer;

static void put(Writer *w, const void *data, size_t length) {
    memcpy(w->p, data, length);
    w->p += length;
}


static void put_lower(Writer *w, const char *text, size_t length) {
    for (size_t i = 0; i < length; i++) {
        char c = text[i];
        *w->p++ = (c >= 'A' && c <= 'Z') ? (char)(c + 32) : c;
    }
}

static void put_bytes(Writer *w, PyObject *bytes) {
    put(w, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
}

/* ---- The connection protocols' C halves ---------------------------------------------------- */

typedef struct ClientBase ClientBase;

typedef struct {
    PyObject_HEAD
    Hub *hub;
    PyObject *transport;
    int closed;
    int busy;
    double deadline;
    double idle_since; /* monotonic seconds it last went idle; 0: never (a fresh connection) */
    PyObject *idle; /* the pool's idle list for this connection's node */
    /* One request the C path forwarded, while it waits for the answer: */
    ClientBase *client;
    PyObject *cached;     /* Cached the candidate came from */
    int shift;            /* index of the candidate tried in cached.candidates */
    PyObject *head;       /* bytes: the request to nodes, without its host line */
    PyObject *request_id; /* bytes */
    PyObject *store;      /* bytes */
    int partition;
    int keep_alive;
    int head_only;
    int http11;           /* the client can read a chunked answer */
    double received_at;   /* time.perf_counter() seconds */
} UpstreamBase;

struct ClientBase {
    PyObject_HEAD
    Hub *hub;
    PyObject *transport;
    PyObject *client_ip; /* bytes */
    int closed;
    int busy;
    int reading;   /* the Python parser is inside a message */
    int attention; /* the Python side must see the end of each response */
    double deadline;
};

static void clear_fast_request(UpstreamBase *up) {
    Py_CLEAR(up->client);
    Py_CLEAR(up->cached);
    Py_CLEAR(up->head);
    Py_CLEAR(up->request_id);
    Py_CLEAR(up->store);
}

static PyTypeObject UpstreamBaseType;

/* Pops a usable idle connection, or NULL (no exception) when there is none. */
static UpstreamBase *pop_idle(PyObject *idle) {
    Py_ssize_t n;
    while ((n = PyList_GET_SIZE(idle)) > 0) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(idle, n - 1));
        if (PyList_SetSlice(idle, n - 1, n, NULL) < 0) {
            Py_DECREF(item);
            PyErr_Clear();
            return NULL;
        }
        if (PyObject_TypeCheck(item, &UpstreamBaseType)) {
            UpstreamBase *up = (UpstreamBase *)item;
            if (!up->closed && !up->busy && up->transport != NULL && up->client == NULL)
                return up;
        }
        Py_DECREF(item);
    }
    return NULL;
}

typedef struct {
    const char *text;
    size_t length;
} Span;

/* The one query parameter named `name`, as parse_qs(keep_blank_values=True) would give it;
 * 0 when it is absent, repeated or needs decoding (the Python path then answers). */
static int query_value(const char *query, size_t length, PyObject *name, Span *out) {
    int found = 0;
    size_t i = 0;
    if (memchr(query, '%', length) != NULL || memchr(query, '+', length) != NULL) return 0;
    while (i <= length) {
        size_t start = i;
        while (i < length && query[i] != '&') i++;
        size_t end = i++;
        if (end == start) continue;
        const char *equals = memchr(query + start, '=', end - start);
        size_t name_end = equals ? (size_t)(equals - query) : end;
        if (equals_bytes(query + start, name_end - start, name)) {
            if (found++) return 0;
            out->text = equals ? equals + 1 : query + end;
            out->length = equals ? end - name_end - 1 : 0;
        }
    }
    return found == 1;
}

/* Route, choose and forward one whole request; 1 when done here, 0 to leave it to Python,
 * -1 with an exception set. Nothing changes anywhere before the last checks pass. */
static int forward_fast(ClientBase *self, const char *data, Py_ssize_t length) {
    Hub *hub = self->hub;
    llhttp_t parser;
    Message m;
    if (length > hub->max_request_bytes || !parse_whole(&parser, HTTP_REQUEST, &m, data, length))
        return 0;
    int method = llhttp_get_method(&parser);
    if ((method != HTTP_GET && method != HTTP_HEAD) || llhttp_get_upgrade(&parser) ||
        m.header_count > hub->max_headers || m.url_length == 0 || m.url[0] != '/' ||
        m.body_length != 0)
        return 0;

    /* The path and its segments, as RouteTable.match splits them. */
    const char *question = memchr(m.url, '?', m.url_length);
    size_t path_length = question ? (size_t)(question - m.url) : m.url_length;
    for (size_t i = 0; i < path_length; i++)
        if (!plain_path_byte((unsigned char)m.url[i])) return 0;
    if (question && !printable_ascii(question, m.url_length - path_length)) return 0;
    Span segments[MAX_SEGMENTS];
    int segment_count = 0;
    size_t start = 1;
    for (size_t i = 1; i <= path_length; i++) {
        if (i == path_length || m.url[i] == '/') {
            if (segment_count == MAX_SEGMENTS) return 0;
            segments[segment_count].text = m.url + start;
            segments[segment_count++].length = i - start;
            start = i + 1;
        }
    }
    Route *route = NULL;
    int route_index = 0;
    for (int r = 0; r < hub->route_count && route == NULL; r++) {
        Route *candidate = &hub->routes[r];
        if (candidate->segments != segment_count) continue;
        int matches = 1;
        for (int i = 0; i < candidate->literals && matches; i++) {
            Span *s = &segments[candidate->literal_index[i]];
            matches = equals_bytes(s->text, s->length, candidate->literal[i]);
        }
        /* The Python path's route: a later route C serves must not take the request (the path
         * is plain bytes here, so literals compare as RouteTable.match compares them). */
        if (matches && !candidate->c_serves) return 0;
        if (matches) {
            route = candidate;
            route_index = r;
        }
    }
    if (route == NULL) return 0; /* not keyed: Python passes it through */

    /* Headers: what is forwarded, what is replaced, what sends the request to Python. */
    const Header *host = NULL, *forwarded_for = NULL, *key_header = NULL;
    const char *request_id = NULL;
    size_t request_id_length = 0, kept_bytes = 0;
    int passed[MAX_FAST_HEADERS]; /* decided once, used when sizing and when writing */
    for (int i = 0; i < m.header_count; i++) {
        const Header *h = &m.headers[i];
        if (!printable_ascii(h->value, h->value_length)) return 0;
        if (route->key_source == KEY_HEADER && key_header == NULL &&
            equals_lower_n(h->name, h->name_length, PyBytes_AS_STRING(route->key_name),
                           (size_t)PyBytes_GET_SIZE(route->key_name)))
            key_header = h;
        if (header_in(h, hub->python_only)) return 0;
        if (header_is(h, "host")) {
            if (host != NULL) return 0;
            host = h;
        } else if (header_is(h, "x-forwarded-for")) {
            if (forwarded_for != NULL) return 0;
            forwarded_for = h;
        } else if (header_is(h, "connection")) {
            if (!plain_connection_value(h->value, h->value_length)) return 0;
        } else if (header_is(h, "x-request-id")) {
            if (valid_request_id(h->value, h->value_length)) {
                request_id = h->value;
                request_id_length = h->value_length;
            }
        }
        passed[i] = passed_on(hub, h);
        if (passed[i])
            kept_bytes += h->name_length + LEN(HEADER_SEPARATOR) + h->value_length + LEN(CRLF);
    }

    /* Store and key. */
    Span store_name, key;
    if (route->store_index >= 0) {
        store_name = segments[route->store_index];
    } else {
        store_name.text = PyBytes_AS_STRING(route->fixed_store);
        store_name.length = PyBytes_GET_SIZE(route->fixed_store);
    }
    if (store_name.length == 0) return 0;
    if (route->key_source == KEY_PATH) {
        key = segments[route->key_index];
    } else if (route->key_source == KEY_QUERY) {
        if (question == NULL ||
            !query_value(question + 1, m.url_length - path_length - 1, route->key_name, &key))
            return 0;
    } else {
        if (key_header == NULL) return 0;
        key.text = key_header->value;
        key.length = key_header->value_length;
    }
    Store *store = NULL;
    for (int s = 0; s < hub->store_count; s++)
        if (equals_bytes(store_name.text, store_name.length, hub->stores[s].name))
            store = &hub->stores[s];
    if (store == NULL || !store->c_serves || route_index >= PyTuple_GET_SIZE(store->partitioners))
        return 0;

    /* Partition: the store's partitioner for this route (a key it refuses is Python's 400). */
    PyObject *key_text = PyUnicode_DecodeASCII(key.text, (Py_ssize_t)key.length, NULL);
    if (key_text == NULL) return -1;
    PyObject *found = PyObject_CallOneArg(PyTuple_GET_ITEM(store->partitioners, route_index),
                                          key_text);
    Py_DECREF(key_text);
    if (found == NULL) {
        PyErr_Clear();
        return 0;
    }
    long partition = PyLong_AsLong(found);
    Py_DECREF(found);
    if (partition < 0 || partition >= PyList_GET_SIZE(store->cache)) {
        PyErr_Clear();
        return 0;
    }

    /* The cached choice, while exact. */
    PyObject *cached_object = PyList_GET_ITEM(store->cache, partition);
    if (!PyObject_TypeCheck(cached_object, &CachedType)) return 0;
    Cached *cached = (Cached *)cached_object;
    long long now_ms = shared_now_ms(hub);
    Py_ssize_t candidate_count = PyTuple_GET_SIZE(cached->candidates);
    if (candidate_count == 0 || !cached_live(cached, now_ms)) return 0;
    /* choice.rotated: only the first spread_width candidates share reads, so a restoring
     * or ejected replica is never tried first. */
    int shift = 0;
    if (hub->spread && cached->spread_width > 1)
        shift = (int)(++hub->spread_counter % (unsigned long long)cached->spread_width);
    Candidate *chosen = (Candidate *)PyTuple_GET_ITEM(cached->candidates, shift);

    /* The request to the node: exactly proxy.http.request_head, then the host line. */
    char generated_id[48];
    if (request_id == NULL) {
        request_id_length = (size_t)format_request_id(hub, generated_id);
        request_id = generated_id;
    }
    const char *method_text = method == HTTP_HEAD ? "HEAD " : "GET ";
    size_t method_length = method == HTTP_HEAD ? LEN("HEAD ") : LEN("GET ");
    size_t head_length = method_length + m.url_length + LEN(HTTP11_LINE_END) + kept_bytes;
    head_length += LEN(FORWARDED_FOR) +
                   (forwarded_for ? forwarded_for->value_length + LEN(FORWARDED_FOR_JOIN) : 0) +
                   PyBytes_GET_SIZE(self->client_ip) + LEN(FORWARDED_PROTO);
    if (host != NULL && host->value_length)
        head_length += LEN(FORWARDED_HOST) + host->value_length + LEN(CRLF);
    head_length += LEN(REQUEST_ID) + request_id_length + LEN(CRLF);
    head_length += (size_t)PyBytes_GET_SIZE(hub->request_lines);
    PyObject *head = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)head_length);
    if (head == NULL) return -1;
    Writer w = {PyBytes_AS_STRING(head)};
    put(&w, method_text, method_length);
    put(&w, m.url, m.url_length);
    put(&w, LIT(HTTP11_LINE_END));
    for (int i = 0; i < m.header_count; i++) {
        const Header *h = &m.headers[i];
        if (!passed[i]) continue;
        put_lower(&w, h->name, h->name_length);
        put(&w, LIT(HEADER_SEPARATOR));
        put(&w, h->value, h->value_length);
        put(&w, LIT(CRLF));
    }
    put_bytes(&w, hub->request_lines); /* where proxy.freshness.with_budget puts them */
    put(&w, LIT(FORWARDED_FOR));
    if (forwarded_for) {
        put(&w, forwarded_for->value, forwarded_for->value_length);
        put(&w, LIT(FORWARDED_FOR_JOIN));
    }
    put_bytes(&w, self->client_ip);
    put(&w, LIT(FORWARDED_PROTO));
    if (host != NULL && host->value_length) {
        put(&w, LIT(FORWARDED_HOST));
        put(&w, host->value, host->value_length);
        put(&w, LIT(CRLF));
    }
    put(&w, LIT(REQUEST_ID));
    put(&w, request_id, request_id_length);
    put(&w, LIT(CRLF));
    if (w.p != PyBytes_AS_STRING(head) + head_length) {
        Py_DECREF(head);
        PyErr_SetString(PyExc_SystemError, "request head size miscounted");
        return -1;
    }

    /* Last: an idle connection to the chosen node. Without one, Python opens it. */
    UpstreamBase *up = pop_idle(chosen->idle);
    if (up == NULL) {
        Py_DECREF(head);
        return 0;
    }
    Py_ssize_t host_line_length = PyBytes_GET_SIZE(chosen->host_line);
    PyObject *message = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)head_length +
                                                            host_line_length + LEN(CRLF));
    PyObject *request_id_bytes = PyBytes_FromStringAndSize(request_id, request_id_length);
    PyObject *store_bytes = Py_NewRef(store->name);
    if (message == NULL || request_id_bytes == NULL) {
        PyList_Append(chosen->idle, (PyObject *)up);
        Py_DECREF(up);
        Py_DECREF(head);
        Py_XDECREF(message);
        Py_XDECREF(request_id_bytes);
        Py_DECREF(store_bytes);
        return -1;
    }
    w.p = PyBytes_AS_STRING(message);
    put_bytes(&w, head);
    put_bytes(&w, chosen->host_line);
    put(&w, LIT(CRLF));

    up->client = (ClientBase *)Py_NewRef(self);
    up->cached = Py_NewRef(cached_object);
    up->shift = shift;
    up->head = head;
    up->request_id = request_id_bytes;
    up->store = store_bytes;
    up->partition = (int)partition;
    up->keep_alive = llhttp_should_keep_alive(&parser);
    up->head_only = method == HTTP_HEAD;
    up->http11 = parser.http_major > 1 || (parser.http_major == 1 && parser.http_minor >= 1);
    up->received_at = monotonic_s();
    up->busy = 1;
    up->deadline = up->received_at + hub->response_timeout_s;
    self->busy = 1;
    hub->in_flight++;
    hub->deposits++;
    hub->forwarded++;
    if (chosen->choice_tally != Py_None) ((Tally *)chosen->choice_tally)->value++;
    ((Tally *)chosen->node_tally)->value++;
    PyObject *written = PyObject_CallMethodOneArg(up->transport, str_write, message);
    Py_DECREF(message);
    Py_DECREF(up);
    if (written == NULL) return -1;
    Py_DECREF(written);
    return 1;
}

static PyObject *ClientBase_data_received(ClientBase *self, PyObject *data) {
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "data must be bytes");
        return NULL;
    }
    if (self->hub != NULL && Py_IS_TYPE(self->hub, &HubType) && self->hub->enabled &&
        !self->busy && !self->reading && !self->closed && !self->attention &&
        self->client_ip != NULL && PyBytes_Check(self->client_ip) && self->transport != NULL) {
        int done = forward_fast(self, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
        if (done < 0) return NULL;
        if (done) Py_RETURN_NONE;
    }
    return PyObject_CallMethodOneArg((PyObject *)self, str_slow_data_received, data);
}

static int ClientBase_traverse(ClientBase *self, visitproc visit, void *arg) {
    Py_VISIT(self->hub);
    Py_VISIT(self->transport);
    return 0;
}

static int ClientBase_clear(ClientBase *self) {
    Py_CLEAR(self->hub);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->client_ip);
    return 0;
}

static void ClientBase_dealloc(ClientBase *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ClientBase_clear(self);
    type->tp_free((PyObject *)self); /* a Python subclass's dealloc releases its type */
}

static PyMethodDef ClientBase_methods[] = {
    {"data_received", (PyCFunction)ClientBase_data_received, METH_O,
     "asyncio.Protocol.data_received: the C path, else slow_data_received."},
    {NULL},
};

static PyMemberDef ClientBase_members[] = {
    {"hub", T_OBJECT, offsetof(ClientBase, hub), 0, NULL},
    {"transport", T_OBJECT, offsetof(ClientBase, transport), 0, NULL},
    {"client_ip_bytes", T_OBJECT, offsetof(ClientBase, client_ip), 0, NULL},
    {"closed", T_INT, offsetof(ClientBase, closed), 0, NULL},
    {"busy", T_INT, offsetof(ClientBase, busy), 0, NULL},
    {"reading", T_INT, offsetof(ClientBase, reading), 0, NULL},
    {"attention", T_INT, offsetof(ClientBase, attention), 0, NULL},
    {"deadline", T_DOUBLE, offsetof(ClientBase, deadline), 0, NULL},
    {NULL},
};

static PyTypeObject ClientBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.ClientBase",
    .tp_basicsize = sizeof(ClientBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)ClientBase_traverse,
    .tp_clear = (inquiry)ClientBase_clear,
    .tp_dealloc = (destructor)ClientBase_dealloc,
    .tp_methods = ClientBase_methods,
    .tp_members = ClientBase_members,
    .tp_doc = "The C half of a client connection.",
};

/* The latency histogram, as ProxyMetrics.observe (bisect_left over the bounds). */
static void observe(Hub *hub, int status, double seconds) {
    int bucket = 0;
    while (bucket < LATENCY_BUCKETS && latency_bounds[bucket] < seconds) bucket++;
    hub->latency_counts[bucket]++;
    hub->latency_sum += seconds;
    hub->status_counts[status]++;
}

/* Answer the client from one whole simple response; 1 done, 0 leave to Python, -1 error. */
static int answer_fast(UpstreamBase *self, const char *data, Py_ssize_t length) {
    Hub *hub = self->hub;
    llhttp_t parser;
    Message m;
    if (!parse_whole(&parser, HTTP_RESPONSE, &m, data, length)) return 0;
    int status = llhttp_get_status_code(&parser);
    /* Python frames the rest: 1xx (absorbed), answers without a body whose Content-Length,
     * if any, is the node's (HEAD, 304) or must go (204), and statuses with no status line
     * (below): the proxy leaves the retry statuses (KROUTE_RETRY_STATUSES) out of the lines
     * it gives the hub, so failover is decided in one place, proxy.exchange, and 5xx when
     * they count towards ejection (proxy.outliers). */
    if (status < 200 || status >= STATUS_SLOTS || status == 204 || status == 304 ||
        self->head_only)
        return 0;
    if ((long long)m.body_length > hub->max_response_bytes) return 0;
    if (m.body != NULL && m.body + m.body_length != data + length) return 0;
    const char *head_end = m.body != NULL ? m.body : data + length;
    if (head_end - data > MAX_RESPONSE_HEAD) return 0;
    PyObject *status_line = hub->status_line[status];
    if (status_line == NULL) return 0;

    /* Each kept header line as the node sent it, as proxy.http.filter_response_head keeps it;
     * a line is checked to run from its name to the next name (no folding, no surprises). */
    size_t kept = 0;
    const char *line_end[MAX_FAST_HEADERS];
    int keep[MAX_FAST_HEADERS];
    for (int i = 0; i < m.header_count; i++) {
        const Header *h = &m.headers[i];
        const char *from = h->value ? h->value + h->value_length : h->name + h->name_length;
        const char *newline = memchr(from, '\n', (size_t)(head_end - from));
        const char *next = i + 1 < m.header_count ? m.headers[i + 1].name : NULL;
        if (newline == NULL || (next != NULL && newline + 1 != next)) return 0;
        if (next == NULL && (head_end - (newline + 1) != 2 || newline[1] != '\r')) return 0;
        for (const char *p = from; p < newline - 1; p++)
            if (*p != ' ' && *p != '\t') return 0; /* only whitespace after the value */
        if (header_is(h, "connection") && !plain_connection_value(h->value, h->value_length))
            return 0;
        if (header_is(h, "transfer-encoding")) return 0;
        keep[i] = !header_in(h, hub->response_drop);
        line_end[i] = newline + 1;
        if (keep[i]) kept += (size_t)(line_end[i] - h->name);
    }

    Cached *cached = (Cached *)self->cached;
    Candidate *chosen = (Candidate *)PyTuple_GET_ITEM(cached->candidates, self->shift);
    /* Ends the node's 5xx streak (proxy/outliers.py): with ejection on, a 5xx has no status
     * line, so every answer served here is below 500. */
    if (status < 500) ((Tally *)chosen->node_tally)->answered++;
    char time_lag[48];
    int time_lag_length = 0;
    long long caught_up_at = candidate_caught_up_at(chosen);
    if (caught_up_at >= 0) { /* the bound grows with time, even at lag 0 */
        long long behind = shared_now_ms(hub) - caught_up_at;
        time_lag_length = snprintf(time_lag, sizeof time_lag, "x-kroute-time-lag-ms: %lld\r\n",
                                   behind > 0 ? behind : 0);
    }
    char content_length[48];
    int content_length_length =
        snprintf(content_length, sizeof content_length, "content-length: %zu\r\n", m.body_length);
    int keep_alive = self->keep_alive && !hub->draining;
    const char *ending = keep_alive ? KEEP_ALIVE_END : CLOSE_END;
    size_t ending_length = keep_alive ? LEN(KEEP_ALIVE_END) : LEN(CLOSE_END);
    size_t total = (size_t)PyBytes_GET_SIZE(status_line) + kept +
                   (size_t)PyBytes_GET_SIZE(chosen->provenance) + (size_t)time_lag_length +
                   LEN(REQUEST_ID) + (size_t)PyBytes_GET_SIZE(self->request_id) + LEN(CRLF) +
                   (size_t)content_length_length + ending_length +
                   (self->head_only ? 0 : m.body_length);
    PyObject *response = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (response == NULL) return -1;
    Writer w = {PyBytes_AS_STRING(response)};
    put_bytes(&w, status_line);
    for (int i = 0; i < m.header_count; i++)
        if (keep[i]) put(&w, m.headers[i].name, (size_t)(line_end[i] - m.headers[i].name));
    put_bytes(&w, chosen->provenance);
    put(&w, time_lag, (size_t)time_lag_length);
    put(&w, LIT(REQUEST_ID));
    put_bytes(&w, self->request_id);
    put(&w, LIT(CRLF));
    put(&w, content_length, (size_t)content_length_length);
    put(&w, ending, ending_length);
    if (!self->head_only && m.body_length) put(&w, m.body, m.body_length);

    /* Hand the connection back before anything can call into Python. */
    ClientBase *client = self->client;
    self->client = NULL;
    int client_keep_alive = keep_alive;
    double received_at = self->received_at;
    clear_fast_request(self);
    self->busy = 0;
    hub->in_flight--;
    int reusable = llhttp_should_keep_alive(&parser) &&
                   PyList_GET_SIZE(self->idle) < hub->idle_per_origin;
    int failed = 0;
    double now = monotonic_s(); /* one clock read: idle since, and the request's latency */
    if (reusable) {
        self->idle_since = now;
        failed = PyList_Append(self->idle, (PyObject *)self) < 0;
    } else {
        PyObject *closed = PyObject_CallMethodNoArgs((PyObject *)self, str_close_now);
        failed = closed == NULL;
        Py_XDECREF(closed);
    }
    observe(hub, status, now - received_at);
    if (!failed && !client->closed && client->transport != NULL) {
        PyObject *written = PyObject_CallMethodOneArg(client->transport, str_write, response);
        failed = written == NULL;
        Py_XDECREF(written);
        client->busy = 0;
        if (!failed) {
            if (!client_keep_alive || client->attention) {
                PyObject *after = PyObject_CallMethodOneArg(
                    (PyObject *)client, str_after_fast_response, client_keep_alive ? Py_True
                                                                                   : Py_False);
                failed = after == NULL;
                Py_XDECREF(after);
            } else if (!client->reading) {
                client->deadline = now + hub->idle_timeout_s;
            }
        }
    }
    Py_DECREF(response);
    Py_DECREF(client);
    return failed ? -1 : 1;
}

static PyObject *UpstreamBase_data_received(UpstreamBase *self, PyObject *data) {
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "data must be bytes");
        return NULL;
    }
    if (self->client != NULL) {
        int usable = self->idle != NULL && PyList_Check(self->idle) && self->hub != NULL &&
                     Py_IS_TYPE(self->hub, &HubType);
        int done = usable ? answer_fast(self, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
                          : 0;
        if (done < 0) return NULL;
        if (done) Py_RETURN_NONE;
        /* Not the simple case: the Python exchange takes over this request from here. */
        PyObject *adopted = PyObject_CallMethodNoArgs((PyObject *)self, str_adopt);
        if (adopted == NULL) return NULL;
        Py_DECREF(adopted);
    }
    return PyObject_CallMethodOneArg((PyObject *)self, str_slow_data_received, data);
}

static int UpstreamBase_traverse(UpstreamBase *self, visitproc visit, void *arg) {
    Py_VISIT(self->hub);
    Py_VISIT(self->transport);
    Py_VISIT(self->idle);
    Py_VISIT(self->client);
    Py_VISIT(self->cached);
    return 0;
}

static int UpstreamBase_clear(UpstreamBase *self) {
    Py_CLEAR(self->hub);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->idle);
    clear_fast_request(self);
    return 0;
}

static void UpstreamBase_dealloc(UpstreamBase *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    UpstreamBase_clear(self);
    type->tp_free((PyObject *)self); /* a Python subclass's dealloc releases its type */
}

static PyObject *UpstreamBase_release_fast(UpstreamBase *self, PyObject *unused) {
    /* The Python side took over the request: forget it here. */
    if (self->client != NULL) self->hub->in_flight--;
    clear_fast_request(self);
    Py_RETURN_NONE;
}

static PyMethodDef UpstreamBase_methods[] = {
    {"data_received", (PyCFunction)UpstreamBase_data_received, METH_O,
     "asyncio.Protocol.data_received: the C path, else slow_data_received."},
    {"release_fast", (PyCFunction)UpstreamBase_release_fast, METH_NOARGS,
     "Forget the C-path request (the Python exchange has taken it over)."},
    {NULL},
};

static PyMemberDef UpstreamBase_members[] = {
    {"hub", T_OBJECT, offsetof(UpstreamBase, hub), 0, NULL},
    {"transport", T_OBJECT, offsetof(UpstreamBase, transport), 0, NULL},
    {"idle", T_OBJECT, offsetof(UpstreamBase, idle), 0, NULL},
    {"closed", T_INT, offsetof(UpstreamBase, closed), 0, NULL},
    {"busy", T_INT, offsetof(UpstreamBase, busy), 0, NULL},
    {"deadline", T_DOUBLE, offsetof(UpstreamBase, deadline), 0, NULL},
    {"idle_since", T_DOUBLE, offsetof(UpstreamBase, idle_since), 0, NULL},
    {"fast_client", T_OBJECT, offsetof(UpstreamBase, client), READONLY, NULL},
    {"fast_cached", T_OBJECT, offsetof(UpstreamBase, cached), READONLY, NULL},
    {"fast_shift", T_INT, offsetof(UpstreamBase, shift), READONLY, NULL},
    {"fast_head", T_OBJECT, offsetof(UpstreamBase, head), READONLY, NULL},
    {"fast_request_id", T_OBJECT, offsetof(UpstreamBase, request_id), READONLY, NULL},
    {"fast_store", T_OBJECT, offsetof(UpstreamBase, store), READONLY, NULL},
    {"fast_partition", T_INT, offsetof(UpstreamBase, partition), READONLY, NULL},
    {"fast_keep_alive", T_INT, offsetof(UpstreamBase, keep_alive), READONLY, NULL},
    {"fast_head_only", T_INT, offsetof(UpstreamBase, head_only), READONLY, NULL},
    {"fast_http11", T_INT, offsetof(UpstreamBase, http11), READONLY, NULL},
    {"fast_received_at", T_DOUBLE, offsetof(UpstreamBase, received_at), READONLY, NULL},
    {NULL},
};

static PyTypeObject UpstreamBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy._hotpath.UpstreamBase",
    .tp_basicsize = sizeof(UpstreamBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)UpstreamBase_traverse,
    .tp_clear = (inquiry)UpstreamBase_clear,
    .tp_dealloc = (destructor)UpstreamBase_dealloc,
    .tp_methods = UpstreamBase_methods,
    .tp_members = UpstreamBase_members,
    .tp_doc = "The C half of a pooled connection to a node.",
};

/* ---- Module ------------------------------------------------------------------------------ */

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT, "proxy._hotpath",
    "The proxy's common case in C; everything else is the Python path.", -1, NULL,
};

PyMODINIT_FUNC PyInit__hotpath(void) {
    llhttp_settings_init(&message_settings);
    message_settings.on_url = on_url;
    message_settings.on_header_field = on_header_field;
    message_settings.on_header_value = on_header_value;
    message_settings.on_header_field_complete = on_header_field_complete;
    message_settings.on_body = on_body;
    message_settings.on_message_complete = on_message_complete;

    str_write = PyUnicode_InternFromString("write");
    str_slow_data_received = PyUnicode_InternFromString("slow_data_received");
    str_after_fast_response = PyUnicode_InternFromString("after_fast_response");
    str_close_now = PyUnicode_InternFromString("close_now");
    str_adopt = PyUnicode_InternFromString("adopt");
    if (!str_write || !str_slow_data_received || !str_after_fast_response || !str_close_now ||
        !str_adopt)
        return NULL;

    PyTypeObject *types[] = {&TallyType, &ReportClockType, &CandidateType,  &CachedType,
                             &HubType,   &ClientBaseType,  &UpstreamBaseType};
    const char *names[] = {"Tally", "ReportClock", "Candidate",   "Cached",
                           "Hub",   "ClientBase",  "UpstreamBase"};
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        if (PyType_Ready(types[i]) < 0 || PyModule_AddObjectRef(module, names[i],
                                                                (PyObject *)types[i]) < 0) {
            Py_DECREF(module);
            return NULL;
        }
    }
    /* proxy.hotpath_spec reads these to decide what the C path serves. */
    if (PyModule_AddIntConstant(module, "MAX_SEGMENTS", MAX_SEGMENTS) < 0 ||
        PyModule_AddIntConstant(module, "KEY_PATH", KEY_PATH) < 0 ||
        PyModule_AddIntConstant(module, "KEY_QUERY", KEY_QUERY) < 0 ||
        PyModule_AddIntConstant(module, "KEY_HEADER", KEY_HEADER) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
