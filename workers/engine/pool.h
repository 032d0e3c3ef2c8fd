/* Helper threads for the CPU kernels: a call's items (a linear layer's panels) shared
   between the calling thread and the pool's helpers.

   One job at a time, published by the thread that calls `pool_run`, which also works on it
   and returns when every item is done; callers take turns (an engine runs one forward at a
   time). Items are claimed one by one from a shared counter,
   so a helper the system does not run at once (the other core busy with the gateway)
   leaves its share to the others instead of holding the call up. Which thread computes an
   item never changes what it computes: the kernels' results do not depend on the threads.

   Between jobs a helper spins for SPIN_NS (a forward's calls come tens of microseconds
   apart), then sleeps until the next job (between forwards). `gen` numbers the jobs: odd
   while the caller rewrites the job, even once it is published; a helper joins a job by
   raising `busy` and then finding `gen` unchanged, and the caller rewrites a job only when
   no helper is inside one (sequentially consistent atomics, so one of the two always sees
   the other). */

#ifndef SPECSPLIT_POOL_H
#define SPECSPLIT_POOL_H

/* an includer defines _GNU_SOURCE before its first include, for pthread_setname_np */

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define SPIN_NS 200000 /* a helper's spin before it sleeps */
#define POOL_THREAD_NAME "specsplit-pool" /* what top -H and /proc call a helper */

/* does item `item` of `job`; `worker` is 0 for the caller, 1 .. helpers for the helpers */
typedef void (*pool_item)(const void *job, int64_t item, int worker);

typedef struct thread_pool {
    int helpers;
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint_fast64_t gen;
    atomic_int_fast64_t busy; /* helpers inside a job */
    atomic_int sleepers; /* helpers asleep, or about to be */
    atomic_int stop;
    atomic_int_fast64_t next; /* the job's first unclaimed item */
    atomic_int_fast64_t left; /* the job's unfinished items */
    pool_item run;
    const void *job;
    int64_t items;
} thread_pool;

typedef struct {
    thread_pool *pool;
    int worker;
} helper_arg;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* claims and does items until none is left */
static void pool_work(thread_pool *p, int worker) {
    for (int64_t i; (i = atomic_fetch_add(&p->next, 1)) < p->items;) {
        p->run(p->job, i, worker);
        atomic_fetch_sub(&p->left, 1);
    }
}

/* spins until `*value` is 0, giving the core away now and then */
static void pool_wait_zero(atomic_int_fast64_t *value) {
    for (int spins = 0; atomic_load(value); spins++)
        if (spins % 64 == 63) sched_yield();
        else _mm_pause();
}

/* the number of the next published job after `seen`, or `seen` once the pool stops */
static uint64_t pool_wait(thread_pool *p, uint64_t seen) {
    const int64_t until = now_ns() + SPIN_NS;
    for (int spins = 0;; spins++) {
        const uint64_t g = atomic_load(&p->gen);
        if (atomic_load(&p->stop)) return seen;
        if (g != seen && g % 2 == 0) return g;
        if (spins % 64 == 63) {
            if (now_ns() > until) break;
            sched_yield(); /* the core to anything else that would run */
        } else {
            _mm_pause();
        }
    }
    pthread_mutex_lock(&p->lock);
    atomic_fetch_add(&p->sleepers, 1);
    uint64_t g;
    while ((g = atomic_load(&p->gen)) == seen || g % 2)
        if (atomic_load(&p->stop)) break;
        else pthread_cond_wait(&p->wake, &p->lock);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->lock);
    return atomic_load(&p->stop) ? seen : g;
}

static void *pool_helper(void *arg) {
    thread_pool *p = ((helper_arg *)arg)->pool;
    const int worker = ((helper_arg *)arg)->worker;
    free(arg);
    uint64_t seen = atomic_load(&p->gen);
    for (;;) {
        const uint64_t g = pool_wait(p, seen);
        if (atomic_load(&p->stop)) return NULL;
        atomic_fetch_add(&p->busy, 1);
        if (atomic_load(&p->gen) == g) {
            pool_work(p, worker);
            seen = g;
        }
        atomic_fetch_sub(&p->busy, 1);
    }
}

static void pool_stop(thread_pool *p, int started) {
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < started; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p->threads);
    free(p);
}

/* a pool of `helpers` threads beside the caller, or NULL (out of memory or threads) */
thread_pool *pool_new(int helpers) {
    thread_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->threads = calloc((size_t)(helpers > 0 ? helpers : 1), sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return NULL;
    }
    p->helpers = helpers;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int i = 0; i < helpers; i++) {
        helper_arg *arg = malloc(sizeof *arg);
        if (arg) *arg = (helper_arg){p, i + 1};
        if (!arg || pthread_create(&p->threads[i], NULL, pool_helper, arg)) {
            free(arg);
            pool_stop(p, i);
            return NULL;
        }
        pthread_setname_np(p->threads[i], POOL_THREAD_NAME);
    }
    return p;
}

void pool_free(thread_pool *p) {
    if (p) pool_stop(p, p->helpers);
}

/* does items 0 .. items - 1 of `job`, on the caller and the pool's helpers (p may be NULL) */
static void pool_run(thread_pool *p, pool_item run, const void *job, int64_t items) {
    if (!p || !p->helpers || items < 2) {
        for (int64_t i = 0; i < items; i++) run(job, i, 0);
        return;
    }
    atomic_fetch_add(&p->gen, 1); /* odd: no helper may join while the job changes */
    pool_wait_zero(&p->busy);
    p->run = run;
    p->job = job;
    p->items = items;
    atomic_store(&p->left, items);
    atomic_store(&p->next, 0);
    atomic_fetch_add(&p->gen, 1); /* even: published */
    if (atomic_load(&p->sleepers)) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
    pool_work(p, 0);
    pool_wait_zero(&p->left);
}

#endif
