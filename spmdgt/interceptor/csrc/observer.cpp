// spmdgt native op observer: a global at::RecordFunction callback that records every ATen op
// (and every c10d op) the dispatcher runs into a compact buffer, and writes instruction-log
// lines (same columns as _instruction_log.py) from C++. See spmdgt/interceptor/_native.py.
//
// Hot path (per op): two callbacks (start: time, depth, shapes/dtypes of the first 4 tensor
// inputs, collective bytes; end: duration, output shapes, one buffer append under a mutex).
// Formatting and file I/O run every kFlushEvery records (or on flush()) under the same mutex,
// on whichever thread filled the buffer. Names are interned (pointer cache checked by strcmp).
//
// No classification lives here: op kinds, event words, the log's column order and dtype names
// come from spmdgt/interceptor/_events.py through set_table() (called by _native._init before
// start), so the Python and C++ levels cannot disagree on what an op is.

#include <ATen/record_function.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <Python.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kMaxSpecs = 4;
constexpr int kMaxDims = 6;
constexpr size_t kFlushEvery = 4096;

struct Spec {
  int8_t ndim;  // -1: more dims than kMaxDims (only the first kMaxDims kept)
  int8_t dtype;
  int8_t truncated;
  int64_t sizes[kMaxDims];
};

struct Rec {
  uint64_t seq;
  int64_t t0;
  int64_t dur;
  int64_t nbytes;
  int32_t name;
  int32_t signal;
  uint8_t level;
  uint8_t phase;
  uint8_t nin;
  uint8_t nout;
  Spec in[kMaxSpecs];
  Spec out[2];
};

struct Ctx : at::ObserverContext {
  int64_t t0;
  int64_t nbytes;
  uint8_t level;
  uint8_t phase;
  uint8_t nin;
  bool comm;
  bool comm_or_wait;  // counted as communication time inside a parent op
  int32_t name;
  Spec in[kMaxSpecs];
};

// Per-op counters for get_worker_stats and top: kept here, under g_mu, for every record, so
// they cost a few adds instead of a Python event per op. Reset only by reset_counters().
struct NameStat {
  int64_t count = 0;   // records, all levels
  int64_t count0 = 0;  // level-0 records (called from Python / the autograd engine)
  int64_t dur = 0;     // ns, all levels
  int64_t own0 = 0;    // ns of level-0 records minus the collectives run inside them
  int64_t bytes = 0;   // collective bytes
};

struct NameInfo {
  std::string key;   // "aten::mul" + '\0' + "Tensor"
  std::string op;    // aten.mul.Tensor
  std::string mid;   // "OP <phase> elementwise aten.mul.Tensor" without phase: event and kind
  std::string event; // OP / COMM / WAIT
  std::string kind;
  bool comm;
  bool wait;
  bool backward;  // an autograd engine node (evaluate_function): phase bwd
  bool skip;      // kind "overhead" (the table's skip kind): never recorded
};

// The table from _events.py (set_table): how ops are classified and how lines are written.
enum Column {
  kElapsed, kRank, kSeq, kEvent, kPhase, kKind, kOp, kBytes, kDur, kLevel, kSignal, kInputs,
  kOutputs, kPlacements, kGroup
};
struct Table {
  bool loaded = false;
  std::unordered_set<std::string> namespaces;                 // dropped by base_name
  std::unordered_map<std::string, std::string> kinds;         // base name -> kind
  std::unordered_map<std::string, std::string> ns_kinds;      // namespace -> kind
  std::unordered_map<std::string, std::string> events;        // kind -> event word
  std::string default_kind, default_event, skip_kind;
  std::string comm_kind, wait_kind;  // _events.COLLECTIVE_KINDS: a transfer, a wait on one
  std::vector<Column> columns;                                // the log's columns, in order
  std::vector<std::string> dtypes;                            // ScalarType int -> short name
};

// ---- global state (guarded by g_mu unless atomic) -------------------------------------------
std::mutex g_mu;
std::vector<Rec> g_buf;
std::deque<NameInfo> g_names;  // stable addresses: read without the lock once interned
std::unordered_map<std::string, int32_t> g_name_ids;
std::vector<std::string> g_signals{"-"};
std::unordered_map<std::string, int32_t> g_signal_ids{{"-", 0}};
Table g_table;  // set once by set_table(), read under g_mu (interning, formatting)
std::atomic<int32_t> g_signal{0};
std::atomic<uint8_t> g_phase{0};  // 0 fwd, 1 bwd, 2 opt
std::atomic<bool> g_enabled{false};
uint64_t g_seq = 0;
uint64_t g_total = 0;
std::vector<NameStat> g_stats;  // by name id
int64_t g_busy = 0;             // ns inside level-0 records
int64_t g_child_comm = 0;       // ns of collectives inside level-0 records
int64_t g_first = -1;           // first record's start, last record's end (ns)
int64_t g_last = 0;
int64_t g_origin = 0;
int g_rank = 0;
std::thread::id g_main_thread;  // the thread that started recording: the rank's own
FILE* g_file = nullptr;
std::string g_path;         // the log's path and header (rotation reopens it)
std::string g_header;
size_t g_max_bytes = 0;     // rotate the log past this many bytes (0: never)
size_t g_written = 0;       // bytes in the current file
size_t g_header_bytes = 0;  // of which the header
uint64_t g_rotations = 0;
uint64_t g_alarm = 0;       // call back once g_total reaches it (0: no alarm)
std::string g_out;  // formatting buffer
at::CallbackHandle g_handle = 0;
at::CallbackHandle g_bwd_handle = 0;
bool g_record_outputs = true;
bool g_write = true;
size_t g_keep = 0;  // records kept for Python drain (0: none), at most kKeepCap
constexpr size_t kKeepCap = 1 << 16;
constexpr size_t kDrainEvery = 4096;
constexpr int64_t kTickNs = 1000000000;
std::vector<Rec> g_kept;
uint64_t g_dropped = 0;  // kept records lost because no GIL-holding thread drained them
int64_t g_next_tick = 0;
py::object* g_callback = nullptr;  // called (GIL held, lock free) at flush points
std::vector<py::object>* g_dtypes = nullptr;  // ScalarType int -> torch.dtype
thread_local bool t_in_callback = false;

// ---- code sampler (the compile pass's hot-function detector; see interceptor/_sampler.py) ----
// Every g_sample_every-th level-0 record on the rank's own thread, the observer takes the GIL
// and walks the Python stack to the innermost *user* frame and counts one sample for that code
// object. Python classifies each code once (g_classify: 0 library: walk on, 1 user: count,
// 2 stop: drop the sample, e.g. code running inside a compiled function). A code reaching
// g_hot_at samples is queued for Python (take_hot) and a callback is requested. By op count,
// never by time: ranks running the same program sample the same ops and decide alike.
std::atomic<bool> g_paused{false};  // no records at all (the pass is compiling: fake-tensor ops)
int64_t g_sample_every = 0;  // 0: no sampling
int64_t g_sample_left = 0;
int64_t g_hot_at = 0;
struct CodeCount {
  int64_t samples = 0;
  int kind = 0;  // 0 library, 1 user, 2 stop
};
py::object* g_classify = nullptr;  // code -> 0/1/2 (once per code object)
std::unordered_map<PyObject*, CodeCount> g_codes;  // a reference held on each key
std::vector<PyObject*> g_hot;  // reached g_hot_at, not yet taken (references held)
int64_t g_samples = 0;

thread_local int t_depth = 0;
thread_local int t_comm_depth = 0;  // recorded collectives open on this thread
thread_local int64_t t_child_comm = 0;  // ns of collectives inside the open level-0 op
thread_local int t_bwd = 0;
struct CacheSlot {
  const char* name = nullptr;
  const char* overload = nullptr;
  int32_t id = -1;
  bool comm = false;
  bool wait = false;
  bool backward = false;
  bool skip = false;
  const std::string* key = nullptr;  // the interned entry's key (deque element: stable)
};
constexpr size_t kCache = 256;
thread_local CacheSlot t_cache[kCache];

const char* kPhases[] = {"fwd", "bwd", "opt"};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

const std::string& dtype_short(int8_t d) {
  static thread_local std::string other;
  size_t i = static_cast<size_t>(static_cast<uint8_t>(d));
  if (i < g_table.dtypes.size()) return g_table.dtypes[i];
  other = c10::toString(static_cast<c10::ScalarType>(d));
  return other;
}

// The same rule as _events.classify, over the table it was handed: a namespace in ns_kinds
// decides; else the base name (namespace and overload dropped, one trailing '_' dropped).
std::string classify(const std::string& op) {
  std::vector<std::string> parts;
  size_t s = 0;
  for (size_t i = 0; i <= op.size(); ++i) {
    if (i == op.size() || op[i] == '.') {
      parts.push_back(op.substr(s, i - s));
      s = i + 1;
    }
  }
  if (parts.size() >= 2) {
    auto nk = g_table.ns_kinds.find(parts[0]);
    if (nk != g_table.ns_kinds.end()) return nk->second;
  }
  std::string name = parts[0];
  if (parts.size() >= 2 && g_table.namespaces.count(parts[0])) name = parts[1];
  if (name.size() >= 1 && name.back() == '_' && !(name.size() >= 2 && name[name.size() - 2] == '_'))
    name.pop_back();
  auto k = g_table.kinds.find(name);
  return k != g_table.kinds.end() ? k->second : g_table.default_kind;
}

// Under g_mu.
int32_t intern_locked(const char* name, const char* overload) {
  std::string key(name);
  key.push_back('\0');
  key += overload;
  auto it = g_name_ids.find(key);
  if (it != g_name_ids.end()) return it->second;
  NameInfo info;
  info.key = key;
  std::string op(name);
  static const std::string kEval = "autograd::engine::evaluate_function: ";
  bool node = op.compare(0, kEval.size(), kEval) == 0;
  if (node) {  // the autograd engine running one backward node: autograd.MulBackward0
    op = "autograd." + op.substr(kEval.size());
    auto q = op.rfind("::");  // torch::autograd::AccumulateGrad -> AccumulateGrad
    if (q != std::string::npos) op = "autograd." + op.substr(q + 2);
  } else {
    auto p = op.find("::");
    if (p != std::string::npos) op.replace(p, 2, ".");
    op += ".";
    op += (overload && *overload) ? overload : "default";
  }
  for (auto& ch : op)
    if (ch == ' ' || ch == '\t' || ch == '\n') ch = '_';
  info.op = op;
  info.backward = node;
  std::string kind = classify(op);  // an engine node is autograd.X: the table says backward
  info.kind = kind;
  auto ev = g_table.events.find(kind);
  info.event = ev != g_table.events.end() ? ev->second : g_table.default_event;
  info.comm = kind == g_table.comm_kind;  // a transfer: its bytes, one record per collective
  info.wait = kind == g_table.wait_kind;  // with comm: communication time
  info.skip = kind == g_table.skip_kind;
  int32_t id = static_cast<int32_t>(g_names.size());
  g_names.push_back(std::move(info));
  g_name_ids.emplace(std::move(key), id);
  return id;
}

// Interned id of the op (and whether it is a collective). A direct-mapped thread-local cache
// keyed by the name pointers, confirmed by strcmp (string-named RecordFunctions own their name,
// so a pointer may be reused for another name).
inline const CacheSlot& name_id(const at::RecordFunction& fn) {
  const char* n = fn.name();
  const char* o = fn.overload_name();
  size_t h = ((reinterpret_cast<uintptr_t>(n) >> 3) ^ (reinterpret_cast<uintptr_t>(o) >> 5)) &
             (kCache - 1);
  CacheSlot& slot = t_cache[h];
  if (slot.name == n && slot.overload == o && slot.key != nullptr) {
    const auto& k = *slot.key;
    size_t nl = std::strlen(n);
    if (std::strncmp(k.c_str(), n, nl + 1) == 0 && std::strcmp(k.c_str() + nl + 1, o) == 0)
      return slot;
  }
  std::lock_guard<std::mutex> g(g_mu);
  int32_t id = intern_locked(n, o);
  slot.name = n;
  slot.overload = o;
  slot.id = id;
  slot.comm = g_names[id].comm;
  slot.wait = g_names[id].wait;
  slot.backward = g_names[id].backward;
  slot.skip = g_names[id].skip;
  slot.key = &g_names[id].key;
  return slot;
}

inline void fill_spec(Spec& s, const at::Tensor& t) {
  auto sizes = t.sizes();
  size_t nd = sizes.size();
  s.truncated = nd > kMaxDims;
  size_t k = nd > kMaxDims ? kMaxDims : nd;
  s.ndim = static_cast<int8_t>(k);
  for (size_t i = 0; i < k; ++i) s.sizes[i] = sizes[i];
  s.dtype = static_cast<int8_t>(t.scalar_type());
}

inline int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size())
                     : 0;
}

// One argument's payload: a tensor, a list of tensors, or a list of lists (c10d.allgather_'s
// Tensor[][] outputs). A collective's bytes are its buffer, the largest such argument or
// output (an all-gather's gathered output, a reduce-scatter's whole input): c10d ops take the
// output buffer as an argument (_allgather_base_(output, input)), and input plus output would
// count an all-gather (n + 1) / n times. The same rule as _mode._comm_bytes.
int64_t payload_bytes(const c10::IValue& v) {
  if (v.isTensor()) return tensor_bytes(v.toTensor());
  int64_t total = 0;
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) total += tensor_bytes(t);
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) total += payload_bytes(x);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) total += payload_bytes(x);
  }
  return total;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (t_in_callback || g_paused.load(std::memory_order_relaxed)) return nullptr;
  const CacheSlot& slot = name_id(fn);
  // The dispatcher's own records around an op (the Python-key kernels: PythonSubclass runs
  // DTensor's __torch_dispatch__) are not ops: no record, no nesting level (their ops are
  // recorded by their own callbacks, at the level they would have without them).
  if (slot.skip) return nullptr;
  // One collective, one record: a backend op (c10d.allreduce_) run inside a collective already
  // being recorded (DTensor's _c10d_functional.all_reduce) is the same transfer, not a second.
  if (slot.comm && t_comm_depth > 0) return nullptr;
  auto ctx = std::make_unique<Ctx>();
  ctx->level = static_cast<uint8_t>(t_depth > 0 ? 1 : 0);
  ++t_depth;
  ctx->comm = slot.comm;
  ctx->comm_or_wait = slot.comm || slot.wait;
  if (slot.comm) ++t_comm_depth;
  ctx->phase = (t_bwd > 0 || slot.backward) ? 1 : g_phase.load(std::memory_order_relaxed);
  ctx->name = slot.id;
  bool comm = slot.comm;
  uint8_t n = 0;
  int64_t nbytes = 0;
  if (fn.needsInputs()) {
    for (const auto& v : fn.inputs()) {
      if (comm) nbytes = std::max(nbytes, payload_bytes(v));
      if (v.isTensor()) {
        const auto& t = v.toTensor();
        if (!t.defined()) continue;
        if (n < kMaxSpecs) fill_spec(ctx->in[n++], t);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) {
          if (!t.defined()) continue;
          if (n < kMaxSpecs) fill_spec(ctx->in[n++], t);
        }
      }
      if (n >= kMaxSpecs && !comm) break;
    }
  }
  ctx->nin = n;
  ctx->nbytes = nbytes;
  ctx->t0 = now_ns();
  return ctx;
}

void format_locked(const Rec& r);

// Start a new file: the current one becomes <path>.1 (replacing an older .1), as
// InstructionLogSink does. The new file starts with the same header (ranks stay aligned) and a
// note, so a reader knows lines came before it.
void rotate_locked() {
  if (g_file == nullptr) return;
  std::fclose(g_file);
  std::string old = g_path + ".1";
  std::rename(g_path.c_str(), old.c_str());
  g_file = std::fopen(g_path.c_str(), "w");
  ++g_rotations;
  g_written = 0;
  if (g_file == nullptr) return;  // the directory went away: stop writing
  std::setvbuf(g_file, nullptr, _IOFBF, 1 << 20);
  std::string head = g_header + "# rotated: earlier lines are in " + old + "\n";
  std::fputs(head.c_str(), g_file);
  g_written = g_header_bytes = head.size();
}

// Write formatted lines, rotating at whole lines once the file would pass g_max_bytes. A line
// longer than the cap still goes into a fresh file on its own (progress over exactness).
void write_locked(const char* p, size_t n) {
  while (n > 0 && g_file != nullptr) {
    if (g_max_bytes == 0 || g_written + n <= g_max_bytes) {
      std::fwrite(p, 1, n, g_file);
      g_written += n;
      return;
    }
    size_t room = g_max_bytes > g_written ? g_max_bytes - g_written : 0;
    size_t cut = 0;
    for (size_t i = room; i > 0; --i) {  // the last whole line that fits
      if (p[i - 1] == '\n') {
        cut = i;
        break;
      }
    }
    if (cut == 0 && g_written <= g_header_bytes) {  // nothing fits a fresh file: one line
      const void* q = std::memchr(p, '\n', n);
      cut = q != nullptr ? static_cast<const char*>(q) - p + 1 : n;
    }
    if (cut > 0) {
      std::fwrite(p, 1, cut, g_file);
      g_written += cut;
      p += cut;
      n -= cut;
    }
    if (n > 0) rotate_locked();
  }
}

void flush_locked() {
  if (g_write && g_file != nullptr && !g_buf.empty()) {
    g_out.clear();
    for (const auto& r : g_buf) format_locked(r);
    write_locked(g_out.data(), g_out.size());
  }
  if (g_keep > 0) {
    g_kept.insert(g_kept.end(), g_buf.begin(), g_buf.end());
    if (g_kept.size() > g_keep) {
      size_t drop = g_kept.size() - g_keep;
      g_dropped += drop;
      g_kept.erase(g_kept.begin(), g_kept.begin() + drop);
    }
  }
  g_buf.clear();
}

// GIL held. Whether a code object is user code (cached per code; the cache holds a reference
// so a freed code's address is never mistaken for another's).
CodeCount& code_entry(PyObject* code) {
  auto it = g_codes.find(code);
  if (it != g_codes.end()) return it->second;
  CodeCount cc;
  if (g_classify != nullptr) {
    PyObject* r = PyObject_CallOneArg(g_classify->ptr(), code);
    if (r == nullptr) {
      PyErr_Clear();
    } else {
      long k = PyLong_AsLong(r);
      if (k == -1 && PyErr_Occurred()) PyErr_Clear();
      else cc.kind = static_cast<int>(k);
      Py_DECREF(r);
    }
  }
  Py_INCREF(code);
  return g_codes.emplace(code, cc).first->second;
}

// GIL held: one sample of the current Python stack. Returns whether a code became hot.
bool sample_stack() {
  PyThreadState* ts = PyThreadState_Get();
  PyFrameObject* frame = ts != nullptr ? PyThreadState_GetFrame(ts) : nullptr;  // new ref
  bool hot = false;
  int depth = 0;
  while (frame != nullptr && depth++ < 64) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new ref
    CodeCount& cc = code_entry(reinterpret_cast<PyObject*>(code));
    if (cc.kind == 2) {  // inside code that must not be counted (a compiled function)
      Py_DECREF(code);
      break;
    }
    if (cc.kind == 1) {
      ++g_samples;
      if (++cc.samples == g_hot_at) {
        Py_INCREF(code);
        g_hot.push_back(reinterpret_cast<PyObject*>(code));
        hot = true;
      }
      Py_DECREF(code);
      break;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new ref
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return hot;
}

bool sample_due(int level);
void callback_if(bool call, int level);

void on_end(const at::RecordFunction& fn, at::ObserverContext* c) {
  int64_t t1 = now_ns();
  auto* ctx = static_cast<Ctx*>(c);
  if (ctx == nullptr) return;
  --t_depth;
  if (ctx->comm) --t_comm_depth;
  Rec r;
  r.t0 = ctx->t0;
  r.dur = t1 - ctx->t0;
  r.nbytes = ctx->nbytes;
  r.name = ctx->name;
  r.signal = g_signal.load(std::memory_order_relaxed);
  r.level = ctx->level;
  r.phase = ctx->phase;
  r.nin = ctx->nin;
  std::memcpy(r.in, ctx->in, sizeof(Spec) * ctx->nin);
  uint8_t no = 0;
  if (g_record_outputs) {
    for (const auto& v : fn.outputs()) {
      if (v.isTensor()) {
        const auto& t = v.toTensor();
        if (t.defined()) fill_spec(r.out[no++], t);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) {
          if (no >= 2) break;
          if (t.defined()) fill_spec(r.out[no++], t);
        }
      }
      if (no >= 2) break;
    }
    if (r.nbytes > 0) {  // a functional collective returns its output buffer
      for (const auto& v : fn.outputs()) r.nbytes = std::max(r.nbytes, payload_bytes(v));
    }
  }
  r.nout = no;
  int64_t child = 0;  // collectives inside this level-0 op (per thread: no lock needed)
  if (r.level == 0) {
    child = t_child_comm;
    t_child_comm = 0;
  } else if (ctx->comm_or_wait) {
    t_child_comm += r.dur;
  }
  bool call = false;
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_enabled.load(std::memory_order_relaxed)) return;
    r.seq = ++g_seq;
    ++g_total;
    if (static_cast<size_t>(r.name) >= g_stats.size()) g_stats.resize(r.name + 64);
    NameStat& st = g_stats[r.name];
    ++st.count;
    st.dur += r.dur;
    st.bytes += r.nbytes;
    if (r.level == 0) {
      ++st.count0;
      st.own0 += r.dur - child;
      g_child_comm += child;
      g_busy += r.dur;
    }
    if (g_first < 0) g_first = r.t0;
    if (r.t0 + r.dur > g_last) g_last = r.t0 + r.dur;
    g_buf.push_back(r);
    size_t pending = g_buf.size() + g_kept.size();
    if (g_buf.size() >= kFlushEvery) flush_locked();
    bool alarm = g_alarm != 0 && g_total >= g_alarm;
    if (alarm) g_alarm = 0;  // one shot: Python compares the count itself at every drain
    if (g_callback != nullptr &&
        (t1 > g_next_tick || (g_keep > 0 && pending >= kDrainEvery) || alarm)) {
      call = true;
      g_next_tick = t1 + kTickNs;
    }
  }
  if (sample_due(ctx->level)) call = true;
  callback_if(call, ctx->level);
}

// Every g_sample_every-th level-0 op on the rank's own thread: one stack sample (GIL taken).
// Whether a code became hot (the Python callback then takes it).
bool sample_due(int level) {
  if (g_sample_every > 0 && level == 0 && !t_in_callback &&
      std::this_thread::get_id() == g_main_thread && --g_sample_left <= 0) {
    g_sample_left = g_sample_every;
    PyGILState_STATE st = PyGILState_Ensure();
    // an op may end while a Python error is on its way out (a dispatch mode raised): keep it
    // aside, or the calls below would clear it ("error return without exception set")
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    bool hot = sample_stack();
    PyErr_Restore(et, ev, etb);
    PyGILState_Release(st);
    return hot;
  }
  return false;
}

// Python sinks run on the rank's own thread, at a top-level op's end. torch's Python bindings
// release the GIL around each op, so that thread takes it back here (as torch's own Python
// hooks do); a backward worker never waits for the GIL: its records wait for the next drain.
void callback_if(bool call, int level) {
  if (!call) return;
  bool own = PyGILState_Check() || std::this_thread::get_id() == g_main_thread;
  if (level == 0 && own) {
    t_in_callback = true;
    try {
      py::gil_scoped_acquire gil;
      PyObject *et, *ev, *etb;  // a Python error on its way out stays set (see sample_due)
      PyErr_Fetch(&et, &ev, &etb);
      py::object cb;
      {
        std::lock_guard<std::mutex> g(g_mu);
        if (g_callback != nullptr) cb = *g_callback;
      }
      try {
        if (cb) cb();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("spmdgt native observer callback");
      } catch (...) {
      }
      PyErr_Restore(et, ev, etb);
    } catch (...) {
    }
    t_in_callback = false;
  } else {
    std::lock_guard<std::mutex> g(g_mu);
    g_next_tick = 0;  // retry at the next top-level op on the rank's thread
  }
}

std::unique_ptr<at::ObserverContext> on_noop_start(const at::RecordFunction&) {
  return nullptr;
}
void on_noop_end(const at::RecordFunction&, at::ObserverContext*) {}

// ---- count only (the compile pass's sampling with no tool on): no inputs, no record ------------
// RecordFunction without inputs costs ~0.1 us an op against ~0.45 us for a full record; the
// nesting (what is a top-level op) and the sampling are the full path's.
struct CountCtx : at::ObserverContext {};
std::atomic<uint64_t> g_counted{0};  // ops counted (counts() adds them to g_total)
bool g_count_only = false;

std::unique_ptr<at::ObserverContext> on_count_start(const at::RecordFunction& fn) {
  if (t_in_callback || g_paused.load(std::memory_order_relaxed)) return nullptr;
  const CacheSlot& slot = name_id(fn);
  if (slot.skip) return nullptr;
  ++t_depth;
  return std::make_unique<CountCtx>();
}

void on_count_end(const at::RecordFunction&, at::ObserverContext* c) {
  if (c == nullptr) return;
  int level = --t_depth > 0 ? 1 : 0;
  g_counted.fetch_add(1, std::memory_order_relaxed);
  if (level == 0) callback_if(sample_due(0), 0);
}

std::unique_ptr<at::ObserverContext> on_bwd_start(const at::RecordFunction&) {
  ++t_bwd;
  return nullptr;
}

void on_bwd_end(const at::RecordFunction&, at::ObserverContext*) { --t_bwd; }

inline void put_u64(std::string& o, uint64_t v, int width = 0) {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v);
  for (int i = n; i < width; ++i) o.push_back('0');
  while (n) o.push_back(tmp[--n]);
}

void put_specs(std::string& o, const Spec* s, int n) {
  if (n == 0) {
    o.push_back('-');
    return;
  }
  for (int i = 0; i < n; ++i) {
    if (i) o.push_back(',');
    if (s[i].ndim == 0) {
      o += "scalar";
    } else {
      for (int d = 0; d < s[i].ndim; ++d) {
        if (d) o.push_back('x');
        put_u64(o, static_cast<uint64_t>(s[i].sizes[d]));
      }
      if (s[i].truncated) o += "x...";
    }
    o.push_back(':');
    o += dtype_short(s[i].dtype);
  }
}

void format_locked(const Rec& r) {
  std::string& o = g_out;
  const NameInfo& ni = g_names[r.name];
  bool first = true;
  for (Column c : g_table.columns) {
    if (!first) o.push_back(' ');
    first = false;
    switch (c) {
      case kElapsed: {
        int64_t us = (r.t0 - g_origin) / 1000;
        if (us < 0) us = 0;
        put_u64(o, us / 1000000);
        o.push_back('.');
        put_u64(o, us % 1000000, 6);
        o.push_back('s');
        break;
      }
      case kRank:
        o.push_back('r');
        put_u64(o, g_rank);
        break;
      case kSeq:
        o.push_back('#');
        put_u64(o, r.seq, 8);
        break;
      case kEvent: o += ni.event; break;
      case kPhase: o += kPhases[r.phase]; break;
      case kKind: o += ni.kind; break;
      case kOp: o += ni.op; break;
      case kBytes:
        put_u64(o, r.nbytes);
        o.push_back('B');
        break;
      case kDur: {
        int64_t d = r.dur / 100;
        put_u64(o, d / 10);
        o.push_back('.');
        put_u64(o, d % 10);
        o += "us";
        break;
      }
      case kLevel: put_u64(o, r.level); break;
      case kSignal: o += g_signals[r.signal]; break;
      case kInputs: put_specs(o, r.in, r.nin); break;
      case kOutputs: put_specs(o, r.out, r.nout); break;
      case kPlacements: o.push_back('-'); break;  // the dispatcher sees local tensors only
      case kGroup: o.push_back('-'); break;       // and no process group (no mesh dim)
    }
  }
  o.push_back('\n');
}

py::tuple spec_tuple(const Spec* s, int n) {
  py::tuple t(n);
  for (int i = 0; i < n; ++i) {
    py::tuple shape(s[i].ndim);
    for (int d = 0; d < s[i].ndim; ++d) shape[d] = s[i].sizes[d];
    size_t dt = static_cast<size_t>(static_cast<uint8_t>(s[i].dtype));
    py::object dtype = (g_dtypes != nullptr && dt < g_dtypes->size())
                           ? (*g_dtypes)[dt]
                           : py::object(py::int_(static_cast<int>(dt)));
    t[i] = py::make_tuple(shape, dtype, py::none());
  }
  return t;
}

// ---- Python API -----------------------------------------------------------------------------
void start(int rank, int64_t origin_ns, bool record_outputs, size_t keep, int noop,
           bool count_only) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_enabled) throw std::runtime_error("native observer already started");
  if (!g_table.loaded) throw std::runtime_error("native observer: set_table() was not called");
  g_rank = rank;
  g_main_thread = std::this_thread::get_id();
  g_origin = origin_ns;
  g_record_outputs = record_outputs;
  g_keep = keep > kKeepCap ? kKeepCap : keep;
  g_kept.clear();
  g_buf.clear();
  g_buf.reserve(kFlushEvery);
  g_out.reserve(kFlushEvery * 128);
  g_next_tick = now_ns() + kTickNs;
  g_enabled = true;
  g_count_only = count_only;
  if (count_only) {  // the compile pass's sampling alone: counts, nesting, samples; no record
    g_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_count_start, on_count_end)
                                         .scopes({at::RecordScope::FUNCTION}));
    return;
  }
  if (noop) {  // measurement only: the cost of the callbacks themselves (1: with inputs)
    g_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_noop_start, on_noop_end)
                                         .needsInputs(noop == 1)
                                         .scopes({at::RecordScope::FUNCTION}));
    return;
  }
  g_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                       .needsInputs(true)
                                       .needsOutputs(record_outputs)
                                       .scopes({at::RecordScope::FUNCTION}));
  g_bwd_handle = at::addGlobalCallback(
      at::RecordFunctionCallback(on_bwd_start, on_bwd_end)
          .scopes({at::RecordScope::BACKWARD_FUNCTION}));
}

void set_keep(size_t keep) {
  std::lock_guard<std::mutex> g(g_mu);
  g_keep = keep > kKeepCap ? kKeepCap : keep;
}

void open_log(const std::string& path, const std::string& header, size_t max_bytes) {
  std::lock_guard<std::mutex> g(g_mu);
  flush_locked();
  if (g_file) std::fclose(g_file);
  g_file = std::fopen(path.c_str(), "w");
  if (!g_file) throw std::runtime_error("cannot open " + path);
  std::setvbuf(g_file, nullptr, _IOFBF, 1 << 20);
  std::fputs(header.c_str(), g_file);
  g_path = path;
  g_header = header;
  g_max_bytes = max_bytes;
  g_written = g_header_bytes = header.size();
  g_rotations = 0;
  g_write = true;
}

// ScalarType int -> torch.dtype for every ScalarType torch has a dtype for (None otherwise):
// Python derives the log's dtype names from these, so no enum table is kept by hand.
py::list scalar_types() {
  py::list out;
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    try {
      out.append(py::cast(static_cast<c10::ScalarType>(i)));
    } catch (...) {
      PyErr_Clear();
      out.append(py::none());
    }
  }
  return out;
}

// The classification table from _events.py (see _native._init): a dict with namespaces,
// kinds (base name -> kind), namespace_kinds, events (kind -> word), default_kind,
// default_event, skip_kind, comm_kind, wait_kind, columns (names, in order) and dtypes
// (ScalarType int -> name).
void set_table(const py::dict& t) {
  static const std::unordered_map<std::string, Column> kColumnNames = {
      {"elapsed", kElapsed}, {"rank", kRank},     {"seq", kSeq},       {"event", kEvent},
      {"phase", kPhase},     {"kind", kKind},     {"op", kOp},         {"bytes", kBytes},
      {"dur", kDur},         {"level", kLevel},   {"signal", kSignal}, {"inputs", kInputs},
      {"outputs", kOutputs}, {"placements", kPlacements}, {"group", kGroup}};
  Table nt;
  for (auto& n : t["namespaces"].cast<std::vector<std::string>>()) nt.namespaces.insert(n);
  nt.kinds = t["kinds"].cast<std::unordered_map<std::string, std::string>>();
  nt.ns_kinds = t["namespace_kinds"].cast<std::unordered_map<std::string, std::string>>();
  nt.events = t["events"].cast<std::unordered_map<std::string, std::string>>();
  nt.default_kind = t["default_kind"].cast<std::string>();
  nt.default_event = t["default_event"].cast<std::string>();
  nt.skip_kind = t["skip_kind"].cast<std::string>();
  nt.comm_kind = t["comm_kind"].cast<std::string>();
  nt.wait_kind = t["wait_kind"].cast<std::string>();
  for (auto& c : t["columns"].cast<std::vector<std::string>>()) {
    auto it = kColumnNames.find(c);
    if (it == kColumnNames.end())
      throw std::runtime_error("native observer cannot write log column '" + c + "'");
    nt.columns.push_back(it->second);
  }
  nt.dtypes = t["dtypes"].cast<std::vector<std::string>>();
  std::vector<py::object>* dtypes = new std::vector<py::object>();  // leaked on purpose
  for (auto d : scalar_types()) dtypes->push_back(py::reinterpret_borrow<py::object>(d));
  nt.loaded = true;
  std::lock_guard<std::mutex> g(g_mu);
  // Names interned under another table would keep its kinds (and threads cache their ids).
  if (g_enabled || !g_names.empty())
    throw std::runtime_error("native observer: set_table() after recording began");
  g_table = std::move(nt);
  g_dtypes = dtypes;
}

void close_log() {
  std::lock_guard<std::mutex> g(g_mu);
  flush_locked();
  if (g_file) {
    std::fclose(g_file);
    g_file = nullptr;
  }
}

void flush() {
  std::lock_guard<std::mutex> g(g_mu);
  flush_locked();
  if (g_file) std::fflush(g_file);
}

// A fresh session: instruction numbers and counters from zero (start() keeps them, so a pause
// and restart continues the same numbering).
void reset_counters() {
  std::lock_guard<std::mutex> g(g_mu);
  g_seq = 0;
  g_total = 0;
  g_counted.store(0);
  g_dropped = 0;
  g_stats.clear();
  g_busy = g_child_comm = g_last = 0;
  g_first = -1;
}

// (total, busy_ns, child_comm_ns, first_ns, last_ns, dropped,
//  [(op, kind, count, count0, dur_ns, own0_ns, bytes), ...] for ops seen)
py::tuple counters() {
  std::vector<std::tuple<std::string, std::string, int64_t, int64_t, int64_t, int64_t, int64_t>>
      rows;
  uint64_t total, dropped;
  int64_t busy, child, first, last;
  {
    std::lock_guard<std::mutex> g(g_mu);
    total = g_total;
    dropped = g_dropped;
    busy = g_busy;
    child = g_child_comm;
    first = g_first;
    last = g_last;
    for (size_t i = 0; i < g_stats.size() && i < g_names.size(); ++i) {
      const NameStat& st = g_stats[i];
      if (st.count == 0) continue;
      rows.emplace_back(g_names[i].op, g_names[i].kind, st.count, st.count0, st.dur, st.own0,
                        st.bytes);
    }
  }
  py::list out;
  for (auto& r : rows) out.append(py::cast(r));
  return py::make_tuple(total, busy, child, first, last, dropped, out);
}

void stop() {
  at::CallbackHandle h = 0, hb = 0;
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_enabled = false;
    h = g_handle;
    hb = g_bwd_handle;
    g_handle = g_bwd_handle = 0;
  }
  if (h) at::removeCallback(h);
  if (hb) at::removeCallback(hb);
  std::lock_guard<std::mutex> g(g_mu);
  flush_locked();
  if (g_file) std::fflush(g_file);
}

void set_signal(py::object name) {
  std::string s = name.is_none() ? std::string("-") : name.cast<std::string>();
  for (auto& ch : s)
    if (ch == ' ') ch = '_';
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_signal_ids.find(s);
  int32_t id;
  if (it == g_signal_ids.end()) {
    id = static_cast<int32_t>(g_signals.size());
    g_signals.push_back(s);
    g_signal_ids.emplace(s, id);
  } else {
    id = it->second;
  }
  g_signal.store(id);
}

// Records kept since the last drain, as (seq, t0, dur, op, kind, level, phase, signal,
// inputs, outputs, nbytes); inputs/outputs are ((shape...), scalar_type_int) pairs.
py::list drain() {
  std::vector<Rec> got;
  std::deque<NameInfo> names;
  std::vector<std::string> sigs;
  {
    std::lock_guard<std::mutex> g(g_mu);
    flush_locked();
    got.swap(g_kept);
    names = g_names;
    sigs = g_signals;
  }
  py::list out;
  std::vector<py::object> opnames, kinds;
  for (const auto& ni : names) {
    opnames.push_back(py::str(ni.op));
    kinds.push_back(py::str(ni.kind));
  }
  std::vector<py::object> sigobjs;
  for (const auto& sg : sigs) sigobjs.push_back(py::str(sg));
  py::str phases[3] = {py::str("fwd"), py::str("bwd"), py::str("opt")};
  for (const auto& r : got) {
    out.append(py::make_tuple(r.seq, r.t0, r.dur, opnames[r.name], kinds[r.name],
                              static_cast<int>(r.level), phases[r.phase],
                              r.signal ? sigobjs[r.signal] : py::none(),
                              spec_tuple(r.in, r.nin), spec_tuple(r.out, r.nout), r.nbytes));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", &start, py::arg("rank"), py::arg("origin_ns"), py::arg("record_outputs") = true,
        py::arg("keep") = 0, py::arg("noop") = 0, py::arg("count_only") = false);
  m.def("stop", &stop);
  m.def("reset_counters", &reset_counters);
  m.def("counters", &counters);
  m.def("flush", &flush);
  m.def("drain", &drain);
  m.def("open_log", &open_log, py::arg("path"), py::arg("header"), py::arg("max_bytes") = 0);
  m.def("log_rotations", []() {
    std::lock_guard<std::mutex> g(g_mu);
    return g_rotations;
  });
  m.def("set_alarm", [](uint64_t at) {
    std::lock_guard<std::mutex> g(g_mu);
    g_alarm = at;
  });
  m.def("set_table", &set_table);
  m.def("classify", [](const std::string& op) {  // the kind the observer gives an op name
    std::lock_guard<std::mutex> g(g_mu);
    return classify(op);
  });
  m.def("scalar_types", &scalar_types);
  m.def("close_log", &close_log);
  m.def("set_keep", &set_keep);
  m.def("set_signal", &set_signal);
  m.def("set_phase", [](int p) { g_phase.store(static_cast<uint8_t>(p)); });
  m.def("set_callback", [](py::object cb) {
    py::object* old = nullptr;
    {
      std::lock_guard<std::mutex> g(g_mu);
      old = g_callback;
      g_callback = cb.is_none() ? nullptr : new py::object(cb);
    }
    delete old;
  });
  m.def("counts", []() {
    std::lock_guard<std::mutex> g(g_mu);
    return py::make_tuple(g_total + g_counted.load(), g_dropped);
  });
  m.def("now_ns", &now_ns);
  m.def("set_paused", [](bool p) { g_paused.store(p); });
  // Sampling for the compile pass: every `every` level-0 records (0: off); a code reaching
  // `hot_at` samples is queued; `classify(code)` -> 0 library, 1 user, 2 stop (once per code).
  m.def("set_sampling", [](int64_t every, int64_t hot_at, py::object classify) {
    g_sample_every = every;
    g_sample_left = every;
    g_hot_at = hot_at;
    py::object* old = g_classify;
    g_classify = classify.is_none() ? nullptr : new py::object(classify);
    delete old;
  });
  m.def("take_hot", []() {  // codes that became hot since the last call (GIL held)
    py::list out;
    for (PyObject* c : g_hot) out.append(py::reinterpret_steal<py::object>(c));
    g_hot.clear();
    return out;
  });
  m.def("code_samples", []() {  // {code: samples} for user codes sampled at least once
    py::dict out;
    for (auto& kv : g_codes)
      if (kv.second.kind == 1 && kv.second.samples > 0)
        out[py::reinterpret_borrow<py::object>(kv.first)] = kv.second.samples;
    return out;
  });
  m.def("reset_sampling", []() {  // forget every count (a new pass session)
    for (PyObject* c : g_hot) Py_DECREF(c);
    g_hot.clear();
    for (auto& kv : g_codes) Py_DECREF(kv.first);
    g_codes.clear();
    g_samples = 0;
    g_sample_left = g_sample_every;
  });
  m.def("samples", []() { return g_samples; });
}
