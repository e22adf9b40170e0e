// The borrowing pool (borrow_pool.h) and its operators:
//
//   start_borrow_pool(int[] own, int[] borrowed) -> int
//       Starts one helper thread per core in `borrowed`, at SCHED_IDLE, allowed on the
//       borrowed cores only (`own`, the worker's cores, which its caller has already pinned it
//       to, pdserve/shell/worker.py, must not be empty; it pins nothing): a helper starved there
//       is stolen from, and on an own core it would only hold chunks the owner, spinning,
//       must then take back. Returns the number of helpers. Once per process.
//   borrow_pool_stats() -> int[]
//       Counts since start: [jobs, helper chunks copied in, chunks the owner stole back,
//       helper chunks dropped (stolen from them), helper stalls the test hook below made].
//   borrow_pool_stall_next(int claims, int microseconds) -> ()
//       Test hook: the next `claims` chunks a helper claims, it sleeps that long before
//       computing (as a helper preempted by its core's owner would), so tests can show that the
//       owner does not wait for it and that its late work is dropped.
//
// A job (Job below) is published through one pointer, with no lock: a helper names the job
// in its hazard slot and checks it is still published, and the owner recycles for a later
// call only jobs no slot names (letting go of their kernel, and with it the inputs, on its
// own thread). So a helper that wakes after the call returned still reads a live job, the
// kernel's inputs included, and finds every chunk taken or stolen. Sleeping helpers wait on a
// futex over the job count.
// Each chunk has a state, which moves only forward:
//   kOpen -> kDone             the owner claimed it and computed it into the output
//   kOpen -> kReady -> kDone   a helper claimed it and computed it into its own buffer; the
//                              owner copies it from there into the output
//   kOpen -> kStolen           a helper claimed it; the owner took it back (and computes it
//                              into the output itself)
// The CAS out of kOpen decides, once, whose result the output gets. Only the owner writes
// the output, so it never waits for a helper: not for a chunk, not for a copy. The helper's
// CAS to kReady releases its buffer's contents; the owner's load of kReady acquires them.
// A helper's buffer has the output's layout and its chunks of one job sit apart in it, and a
// helper takes a later job only once the owner has copied what it needs (the job's end), so
// the owner reads each ready chunk while nobody writes it.
#include "borrow_pool.h"

#include <ATen/ATen.h>
#include <immintrin.h>
#include <pthread.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <climits>
#include <thread>
#include <vector>

namespace pdserve {
namespace {

constexpr int kSpinWait = 20000;  // pause loops before sleeping: about the gap between two kernels
enum State : uint8_t { kOpen, kReady, kDone, kStolen };

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Chunk {
  int64_t begin = 0, end = 0;
  std::atomic<uint8_t> state{kOpen};
  std::atomic<int64_t> claimed_ns{0};  // when a helper claimed it (0: not yet noted)
  const void* ready_in = nullptr;      // a ready chunk's helper buffer (written before kReady)
};

// One kernel call. The owner recycles these (their chunk arrays keep their room), so a call
// allocates nothing here once the pool is warm.
struct Job {
  void reset(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> k, void* o) {
    kernel = std::move(k);
    out = o;
    // Guided sizes: a share of what is left, so the last chunks (the ones a late helper may
    // still hold when the owner runs out) are the smallest, down to min_chunk.
    floor = min_chunk;
    count = 0;
    for (int64_t b = 0; b < n; ++count) b = std::min(n, b + std::max(floor, (n - b + divisor - 1) / divisor));
    if (count > room) {
      chunks.reset(new Chunk[count]);
      room = count;
    }
    for (int64_t i = 0, b = 0; i < count; ++i) {
      Chunk& c = chunks[i];
      c.begin = b;
      c.end = b = std::min(n, b + std::max(floor, (n - b + divisor - 1) / divisor));
      c.state.store(kOpen, std::memory_order_relaxed);
      c.claimed_ns.store(0, std::memory_order_relaxed);
      c.ready_in = nullptr;
    }
    next.store(0, std::memory_order_relaxed);
    helpers_in.store(0, std::memory_order_relaxed);
  }

  std::shared_ptr<const ChunkKernel> kernel;  // dropped by the owner when it recycles the job
  void* out = nullptr;                        // written by the owner alone
  std::unique_ptr<Chunk[]> chunks;
  int64_t count = 0, room = 0, floor = 1;
  std::atomic<int64_t> next{0};  // the next unclaimed chunk
  std::atomic<int64_t> helpers_in{0};
};

// A helper's private output, grown to the largest job it took part in; never zeroed (a chunk
// writes all it copies).
class Shadow {
 public:
  ~Shadow() { std::free(p_); }
  void* get(int64_t bytes) {
    if (bytes > size_) {
      std::free(p_);
      size_ = (bytes + 4095) / 4096 * 4096;
      p_ = std::aligned_alloc(4096, static_cast<size_t>(size_));
      TORCH_CHECK(p_ != nullptr, "borrow pool: out of memory for a helper's ", size_, " byte output buffer");
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  int64_t size_ = 0;
};

struct Counters {
  std::atomic<int64_t> jobs{0}, committed{0}, stolen{0}, dropped{0}, stalled{0};
};

class BorrowPool {
 public:
  int64_t start(const std::vector<int64_t>& borrowed, const cpu_set_t& all) {
    hazards_ = std::vector<std::atomic<Job*>>(borrowed.size());
    for (size_t i = 0; i < borrowed.size(); ++i) threads_.emplace_back([this, all, i] { helper(all, hazards_[i]); });
    return static_cast<int64_t>(threads_.size());
  }

  bool active() const { return !threads_.empty(); }

  void run(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> kernel, void* out) {
    // One job at a time. A kernel called from inside a chunk runs here (no nesting), and so
    // does one called by a second thread while a job is out.
    if (t_in_chunk || owner_.exchange(true, std::memory_order_acquire)) {
      kernel->compute(0, n, out);
      return;
    }
    struct Release {
      std::atomic<bool>& owner;
      ~Release() { owner.store(false, std::memory_order_release); }
    } release{owner_};
    Job* job = fresh_job();
    job->reset(n, min_chunk, divisor, std::move(kernel), out);
    counters_.jobs.fetch_add(1, std::memory_order_relaxed);
    // Published with no lock a helper could hold while preempted (nor one it takes at all):
    // helpers find the job through current_, guarded by their hazard slots (fresh_job).
    current_.store(job, std::memory_order_seq_cst);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) syscall(SYS_futex, &gen_, FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    std::exception_ptr error;
    const int64_t ns_per_item = own_chunks(*job, &error);
    current_.store(nullptr, std::memory_order_seq_cst);  // a helper that comes later finds nothing
    take_back(*job, ns_per_item, &error);
    in_use_.push_back(job);
    last_helpers_ = job->helpers_in.load(std::memory_order_relaxed);
    if (error) std::rethrow_exception(error);  // every chunk is settled: `out` is complete or abandoned
  }

  int64_t last_helpers() const { return last_helpers_; }
  const Counters& counters() const { return counters_; }
  void stall_next(int64_t claims, int64_t us) {
    stall_us_.store(us, std::memory_order_relaxed);
    stall_claims_.store(claims, std::memory_order_release);
  }

 private:
  // A job for the next call: a finished one no helper holds any more, else a new one. The
  // kernel of a finished job (its inputs) is let go here, on the owner's thread: a helper at
  // idle priority never frees (a free takes the allocator's lock, and a helper preempted
  // holding it would stall the owner's next allocation). A job a stalled helper still holds
  // waits in in_use_ until it lets go.
  Job* fresh_job() {
    for (size_t i = 0; i < in_use_.size();) {
      if (held(in_use_[i])) {
        ++i;
        continue;
      }
      in_use_[i]->kernel.reset();
      idle_.push_back(in_use_[i]);
      in_use_[i] = in_use_.back();
      in_use_.pop_back();
    }
    if (idle_.empty()) {
      jobs_.push_back(std::make_unique<Job>());
      return jobs_.back().get();
    }
    Job* job = idle_.back();
    idle_.pop_back();
    return job;
  }

  bool held(const Job* job) const {
    for (const auto& h : hazards_)
      if (h.load(std::memory_order_seq_cst) == job) return true;
    return false;
  }

  // The owner: claims and computes chunks until none is left unclaimed. Returns its time per
  // item (0: it computed none), the yardstick for how long a helper's chunk should take.
  int64_t own_chunks(Job& job, std::exception_ptr* error) {
    int64_t items = 0;
    const int64_t t0 = now_ns();
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_acq_rel)) < job.count;) {
      const int64_t b = job.chunks[i].begin, e = job.chunks[i].end;
      compute(job, b, e, job.out, error);
      job.chunks[i].state.store(kDone, std::memory_order_relaxed);  // only the owner reads its own chunks' state
      items += e - b;
    }
    return items ? std::max<int64_t>(1, (now_ns() - t0) / items) : 0;
  }

  // The owner, once nothing is unclaimed: every helper chunk is copied in from its helper's
  // buffer, or stolen and computed here. A helper still on its chunk gets the time the owner
  // would need for it (and a quarter more) from its claim, then loses it.
  void take_back(Job& job, int64_t ns_per_item, std::exception_ptr* error) {
    for (int64_t i = 0; i < job.count; ++i) {
      const int64_t b = job.chunks[i].begin, e = job.chunks[i].end;
      uint8_t s = job.chunks[i].state.load(std::memory_order_acquire);
      if (s == kOpen) {
        int64_t claimed = job.chunks[i].claimed_ns.load(std::memory_order_relaxed);
        const int64_t deadline = (claimed ? claimed : now_ns()) + (e - b) * ns_per_item * 5 / 4 + 10000;
        while (s == kOpen && now_ns() < deadline) {
          _mm_pause();
          s = job.chunks[i].state.load(std::memory_order_acquire);
        }
        if (s == kOpen && job.chunks[i].state.compare_exchange_strong(s, kStolen, std::memory_order_acq_rel)) {
          counters_.stolen.fetch_add(1, std::memory_order_relaxed);
          compute(job, b, e, job.out, error);
          continue;
        }
      }
      if (s == kReady) {  // (a failed CAS above left the state it met in s: kReady)
        job.kernel->copy(b, e, job.chunks[i].ready_in, job.out);
        job.chunks[i].state.store(kDone, std::memory_order_relaxed);
        counters_.committed.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void compute(const Job& job, int64_t b, int64_t e, void* out, std::exception_ptr* error) {
    t_in_chunk = true;
    try {
      job.kernel->compute(b, e, out);
    } catch (...) {  // kept for the caller, who rethrows it once every chunk is settled
      if (!*error) *error = std::current_exception();
    }
    t_in_chunk = false;
  }

  // A helper on one job: claims chunks, computes each into its shadow, and marks ready what the
  // owner has not stolen meanwhile.
  void help(Job& job, Shadow& shadow) {
    bool joined = false;
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_acq_rel)) < job.count;) {
      job.chunks[i].claimed_ns.store(now_ns(), std::memory_order_relaxed);
      if (!joined) job.helpers_in.fetch_add(1, std::memory_order_relaxed), joined = true;
      if (job.chunks[i].state.load(std::memory_order_acquire) != kOpen) {  // stolen before it began
        counters_.dropped.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      maybe_stall();
      const int64_t b = job.chunks[i].begin, e = job.chunks[i].end;
      void* mine = nullptr;
      std::exception_ptr failed;
      try {
        mine = shadow.get(job.kernel->out_bytes());
      } catch (...) {
        failed = std::current_exception();
      }
      if (mine) compute(job, b, e, mine, &failed);
      uint8_t open = kOpen;
      job.chunks[i].ready_in = mine;
      // A failed chunk stays open: the owner steals it and meets the error itself.
      if (failed || !job.chunks[i].state.compare_exchange_strong(open, kReady, std::memory_order_acq_rel))
        counters_.dropped.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void maybe_stall() {
    int64_t left = stall_claims_.load(std::memory_order_acquire);
    while (left > 0 && !stall_claims_.compare_exchange_weak(left, left - 1, std::memory_order_acq_rel)) {
    }
    if (left <= 0) return;
    counters_.stalled.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::microseconds(stall_us_.load(std::memory_order_relaxed)));
  }

  void helper(cpu_set_t all, std::atomic<Job*>& hazard) {
    sched_param none{};
    pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &all);
    sched_setscheduler(0, SCHED_IDLE, &none);
    Shadow shadow;
    uint32_t seen = 0;
    for (;;) {
      uint32_t g = gen_.load(std::memory_order_seq_cst);
      for (int spin = 0; g == seen && spin < kSpinWait; ++spin) {
        _mm_pause();
        g = gen_.load(std::memory_order_seq_cst);
      }
      if (g == seen) {  // asleep until the owner publishes (it wakes sleepers after its increment)
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while ((g = gen_.load(std::memory_order_seq_cst)) == seen)
          syscall(SYS_futex, &gen_, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = g;
      // A hazard slot: the owner recycles no job a slot names, and this one is checked to be
      // still published after the slot names it (so the owner's scan cannot have missed it).
      Job* job = current_.load(std::memory_order_seq_cst);
      if (!job) continue;
      hazard.store(job, std::memory_order_seq_cst);
      if (current_.load(std::memory_order_seq_cst) == job) help(*job, shadow);
      hazard.store(nullptr, std::memory_order_release);  // the last touch: the owner may recycle it now
    }
  }

  static thread_local bool t_in_chunk;
  std::vector<std::thread> threads_;
  std::atomic<Job*> current_{nullptr};  // the job out now (null between calls)
  std::atomic<uint32_t> gen_{0};        // jobs published (a futex word: sleeping helpers wait on it)
  std::atomic<int> sleepers_{0};
  std::vector<std::atomic<Job*>> hazards_;  // one per helper: the job it reads
  // The owner's: every job (jobs_), those between calls (idle_), those last used (in_use_).
  std::vector<std::unique_ptr<Job>> jobs_;
  std::vector<Job*> idle_, in_use_;
  std::atomic<bool> owner_{false};  // a thread is in run() with a job out
  std::atomic<int64_t> stall_claims_{0}, stall_us_{0};
  Counters counters_;
  int64_t last_helpers_ = 0;
};

thread_local bool BorrowPool::t_in_chunk = false;

BorrowPool& pool() {
  static BorrowPool* p = new BorrowPool();  // never destroyed: its helpers live as long as the process
  return *p;
}

std::once_flag g_started;

int64_t start_borrow_pool(std::vector<int64_t> own, std::vector<int64_t> borrowed) {
  TORCH_CHECK(!own.empty(), "start_borrow_pool: a worker needs at least one core of its own");
  int64_t helpers = -1;
  std::call_once(g_started, [&] {
    cpu_set_t lent;
    CPU_ZERO(&lent);
    for (int64_t c : borrowed) CPU_SET(static_cast<int>(c), &lent);
    helpers = pool().start(borrowed, lent);
  });
  TORCH_CHECK(helpers >= 0, "start_borrow_pool: the pool of this process is already started");
  return helpers;
}

std::vector<int64_t> borrow_pool_stats() {
  const Counters& c = pool().counters();
  return {c.jobs.load(), c.committed.load(), c.stolen.load(), c.dropped.load(), c.stalled.load()};
}

void borrow_pool_stall_next(int64_t claims, int64_t microseconds) {
  TORCH_CHECK(claims >= 0 && microseconds >= 0 && microseconds <= 10000000, "borrow_pool_stall_next: claims must "
              "be >= 0 and microseconds in [0, 10000000], got claims=", claims, ", microseconds=", microseconds);
  pool().stall_next(claims, microseconds);
}

}  // namespace

bool borrow_pool_active() { return pool().active(); }

void borrow_pool_run(int64_t n, int64_t min_chunk, int64_t divisor, std::shared_ptr<const ChunkKernel> kernel,
                     void* out) {
  pool().run(n, min_chunk, divisor, std::move(kernel), out);
}

int64_t borrow_pool_helpers() { return pool().last_helpers(); }

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("start_borrow_pool(int[] own, int[] borrowed) -> int", &pdserve::start_borrow_pool);
  m.def("borrow_pool_helpers() -> int", &pdserve::borrow_pool_helpers);
  m.def("borrow_pool_stats() -> int[]", &pdserve::borrow_pool_stats);
  m.def("borrow_pool_stall_next(int claims, int microseconds) -> ()", &pdserve::borrow_pool_stall_next);
}
