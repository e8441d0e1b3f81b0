/* The cpu backend's thread pool: threads - 1 persistent workers plus the calling thread. A job is n tasks handed
 * out one at a time by an atomic counter (tasks differ in size: sequences of different lengths); the caller
 * waits until every task has finished. One pool per engine; jobs of one pool never overlap (an engine is not
 * thread-safe, kvq.h). */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "alloc.h"
#include "cpu.h"

struct cpu_pool {
    int threads; /* including the caller */
    pthread_t *tid;
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    /* the current job */
    cpu_task_fn fn;
    void *arg;
    int n;
    atomic_int next;
    int generation; /* bumped per job, under mu */
    int busy;       /* workers still inside the current job */
    int quit;
};

static void run_tasks(cpu_pool *p)
{
    for (;;) {
        int i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n) break;
        p->fn(p->arg, i);
    }
}

static void *worker(void *arg)
{
    cpu_pool *p = arg;
    int seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
        if (p->quit) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

kvq_status cpu_pool_create(int threads, cpu_pool **out)
{
    *out = NULL;
    if (threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (int)(n > 1024 ? 1024 : n) : 1;
    }
    cpu_pool *p = kvq_calloc(1, sizeof *p);
    if (!p) return KVQ_ERR_NOMEM;
    p->threads = threads;
    atomic_init(&p->next, 0);
    if (pthread_mutex_init(&p->mu, NULL)) {
        kvq_free(p);
        return KVQ_ERR_NOMEM;
    }
    if (pthread_cond_init(&p->wake, NULL)) {
        pthread_mutex_destroy(&p->mu);
        kvq_free(p);
        return KVQ_ERR_NOMEM;
    }
    if (pthread_cond_init(&p->done, NULL)) {
        pthread_cond_destroy(&p->wake);
        pthread_mutex_destroy(&p->mu);
        kvq_free(p);
        return KVQ_ERR_NOMEM;
    }
    if (threads > 1) {
        p->tid = kvq_malloc((size_t)(threads - 1) * sizeof *p->tid);
        if (!p->tid) {
            cpu_pool_free(p);
            return KVQ_ERR_NOMEM;
        }
        for (int i = 0; i < threads - 1; i++) {
            if (pthread_create(&p->tid[i], NULL, worker, p)) {
                cpu_pool_free(p);
                return KVQ_ERR_NOMEM;
            }
            p->n_started++;
        }
    }
    *out = p;
    return KVQ_OK;
}

void cpu_pool_free(cpu_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->tid[i], NULL);
    kvq_free(p->tid);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    kvq_free(p);
}

int cpu_pool_threads(const cpu_pool *p) { return p->threads; }

void cpu_pool_run(cpu_pool *p, cpu_task_fn fn, void *arg, int n)
{
    if (n <= 0) return;
    if (p->n_started == 0 || n == 1) {
        for (int i = 0; i < n; i++) fn(arg, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    atomic_store(&p->next, 0);
    p->busy = p->n_started;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
