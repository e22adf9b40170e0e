// The borrowing pool (borrow_pool.h) and its operator:
//
//   start_borrow_pool(int[] own, int[] borrowed) -> int
//       Pins the calling thread's process to `own`, and starts one helper thread per core in
//       `borrowed`, at SCHED_IDLE, allowed on own + borrowed (so a starved helper can move
//       to an own core that went idle). Returns the number of helpers. Once per process.
//
// A job is a ticket: generation (high 32 bits) and the next unclaimed index (low 32 bits),
// claimed by compare-and-swap. A helper reads the ticket and the job (function, size, chunk)
// together under one lock, the lock the caller publishes them with, and claims only under
// that generation; the caller publishes the next job only once every chunk of this one is
// claimed and done. So no helper runs a chunk of a job it did not read whole. (Reading the
// fields apart from the ticket once paired a finished job's generation with the next job's
// size: a claim past the old end ran after its caller had returned and freed its buffers.)
#include "borrow_pool.h"

#include <ATen/ATen.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace pdserve {
namespace {

constexpr int kSpinWait = 20000;  // pause loops before sleeping: about the gap between two kernels

class BorrowPool {
 public:
  int64_t start(const std::vector<int64_t>& borrowed, const cpu_set_t& all) {
    for (size_t i = 0; i < borrowed.size(); ++i) threads_.emplace_back([this, all] { helper(all); });
    return static_cast<int64_t>(threads_.size());
  }

  bool active() const { return !threads_.empty(); }

  void run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    // One job at a time. A kernel called from inside a chunk runs here (no nesting), and so
    // does one called by a second thread while a job is out: run() keeps a single job's
    // fields, and a second owner would overwrite the first one's while its helpers read them.
    if (t_in_chunk || owner_.exchange(true, std::memory_order_acquire)) {
      fn(0, n);
      return;
    }
    struct Release {
      std::atomic<bool>& owner;
      ~Release() { owner.store(false, std::memory_order_release); }
    } release{owner_};
    const uint32_t gen = ++gen_;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    helpers_in_.store(0, std::memory_order_relaxed);
    {
      // The job and its ticket change together, under the lock a helper reads them with:
      // a helper never pairs one job's generation with another's size or function.
      std::lock_guard<std::mutex> lock(mu_);
      job_ = Job{&fn, n, chunk};
      ticket_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    work(gen, &fn, n, chunk);
    // Every chunk is claimed now; wait for those a helper still runs, asleep after a short
    // spin, so this core is idle and a preempted helper can be moved here to finish.
    for (int spin = 0; done_.load(std::memory_order_acquire) < n; ++spin) {
      if (spin < kSpinWait) _mm_pause();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    last_helpers_ = helpers_in_.load(std::memory_order_relaxed);
    if (error_) std::rethrow_exception(error_);  // after every chunk ended: nothing uses fn now
  }

  int64_t last_helpers() const { return last_helpers_; }

 private:
  // Claims and runs chunks of job `gen` until none is left; returns how many it ran.
  int64_t work(uint32_t gen, const std::function<void(int64_t, int64_t)>* fn, int64_t n, int64_t chunk) {
    int64_t ran = 0;
    for (uint64_t cur = ticket_.load(std::memory_order_acquire);;) {
      if ((cur >> 32) != gen) return ran;
      const int64_t b = static_cast<int64_t>(cur & 0xFFFFFFFFu);
      if (b >= n) return ran;
      if (!ticket_.compare_exchange_weak(cur, cur + static_cast<uint64_t>(chunk), std::memory_order_acq_rel))
        continue;  // cur now holds the ticket's new value
      const int64_t e = std::min(n, b + chunk);
      t_in_chunk = true;
      try {
        (*fn)(b, e);
      } catch (...) {  // kept for the caller; the chunk still counts as ended, or it would wait forever
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      t_in_chunk = false;
      done_.fetch_add(e - b, std::memory_order_release);
      ++ran;
      cur = ticket_.load(std::memory_order_acquire);
    }
  }

  void helper(cpu_set_t all) {
    sched_param none{};
    pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &all);
    sched_setscheduler(0, SCHED_IDLE, &none);
    uint32_t seen = 0;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      for (int spin = 0; (t >> 32) == seen && spin < kSpinWait; ++spin) {
        _mm_pause();
        t = ticket_.load(std::memory_order_acquire);
      }
      if ((t >> 32) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        t = ticket_.load(std::memory_order_acquire);
      }
      Job job;
      {
        std::lock_guard<std::mutex> lock(mu_);  // the job of exactly this generation
        t = ticket_.load(std::memory_order_acquire);
        job = job_;
      }
      seen = static_cast<uint32_t>(t >> 32);
      // A later job may start at any moment: then every claim under `seen` fails.
      if (work(seen, job.fn, job.n, job.chunk) > 0) helpers_in_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  static thread_local bool t_in_chunk;
  std::vector<std::thread> threads_;
  std::mutex mu_, error_mu_;
  std::exception_ptr error_;
  std::condition_variable cv_;
  std::atomic<uint64_t> ticket_{0};
  struct Job {
    const std::function<void(int64_t, int64_t)>* fn = nullptr;
    int64_t n = 0, chunk = 1;
  };
  Job job_;  // guarded by mu_, with the ticket's generation
  std::atomic<int64_t> done_{0}, helpers_in_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> owner_{false};  // a thread is in run() with a job out
  uint32_t gen_ = 0;
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
    cpu_set_t own_set, all;
    CPU_ZERO(&own_set);
    for (int64_t c : own) CPU_SET(static_cast<int>(c), &own_set);
    all = own_set;
    for (int64_t c : borrowed) CPU_SET(static_cast<int>(c), &all);
    helpers = pool().start(borrowed, all);
  });
  TORCH_CHECK(helpers >= 0, "start_borrow_pool: the pool of this process is already started");
  return helpers;
}

}  // namespace

bool borrow_pool_active() { return pool().active(); }

void borrow_pool_run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  pool().run(n, chunk, fn);
}

int64_t borrow_pool_helpers() { return pool().last_helpers(); }

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("start_borrow_pool(int[] own, int[] borrowed) -> int", &pdserve::start_borrow_pool);
  m.def("borrow_pool_helpers() -> int", &pdserve::borrow_pool_helpers);
}
