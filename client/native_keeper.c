/* slipstream's client hot paths: the client's keepalive thread (Aeron's client conductor's
 * keepalive duty: the client's heartbeat timestamp counter written every keepalive interval,
 * the driver's own heartbeat checked against the driver timeout).  It runs on a thread of its
 * own, without the GIL, and also watches the driver's lock and counters file for a driver
 * that exited or was replaced; it tells Python through a file descriptor.  See native.h for
 * the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

struct ss_keeper {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t stop_changed;  /* on CLOCK_MONOTONIC */
    int stop;
    ss_keeper_params_t p;  /* its paths point at the two below */
    char *lock_path;
    char *counters_path;
};

/* Whether some process holds the driver's lock: a shared lock we could take means none does. */
static int keeper_driver_holds_lock(const char *lock_path) {
    int fd = open(lock_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;  /* only a missing file says the driver is gone */
    int held = 1;  /* EWOULDBLOCK; any other failure is no verdict: look again next beat */
    if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
        flock(fd, LOCK_UN);
        held = 0;
    }
    close(fd);
    return held;
}

static int keeper_owns_heartbeat(const struct ss_keeper *k) {
    return LOAD_ACQ(k->p.state) == k->p.allocated_state
        && LOAD_ACQ(k->p.type) == k->p.heartbeat_type
        && LOAD_ACQ(k->p.registration) == k->p.registration_id;
}

static void *keeper_run(void *arg) {
    struct ss_keeper *k = arg;
    struct timespec due;
    clock_gettime(CLOCK_MONOTONIC, &due);
    pthread_mutex_lock(&k->lock);
    while (!k->stop) {
        pthread_mutex_unlock(&k->lock);
        if (keeper_owns_heartbeat(k)) STORE_REL(k->p.heartbeat, monotonic_ns());
        uint8_t verdict = 0;
        struct stat counters;
        const int counters_seen = stat(k->counters_path, &counters) == 0;
        const int counters_gone = !counters_seen && errno == ENOENT;
        if (!keeper_driver_holds_lock(k->lock_path) || counters_gone) {
            verdict = SS_KEEPER_DRIVER_EXITED;
        } else if (counters_seen && ((uint64_t)counters.st_dev != k->p.counters_device
                                     || (uint64_t)counters.st_ino != k->p.counters_inode)) {
            /* A driver that crashed and was restarted between two beats holds the lock
             * again, in new files: ours are no longer anyone's. */
            verdict = SS_KEEPER_DRIVER_REPLACED;
        } else if (k->p.driver_timeout_ns > 0) {  /* also when stat failed otherwise */
            struct timespec wall;
            clock_gettime(CLOCK_REALTIME, &wall);
            const int64_t wall_ns = (int64_t)wall.tv_sec * 1000000000LL + wall.tv_nsec;
            if (wall_ns - LOAD_ACQ(k->p.driver_heartbeat) > k->p.driver_timeout_ns)
                verdict = SS_KEEPER_DRIVER_STOPPED;
        }
        if (verdict) {
            while (write(k->p.notify_fd, &verdict, 1) < 0 && errno == EINTR) {}
            return NULL;
        }
        int64_t next = (int64_t)due.tv_sec * 1000000000LL + due.tv_nsec + k->p.interval_ns;
        const int64_t now_ns = monotonic_ns();
        if (next < now_ns) next = now_ns + k->p.interval_ns;  /* after a stop (SIGSTOP): no burst */
        due.tv_sec = next / 1000000000LL;
        due.tv_nsec = next % 1000000000LL;
        pthread_mutex_lock(&k->lock);
        while (!k->stop && pthread_cond_timedwait(&k->stop_changed, &k->lock, &due) != ETIMEDOUT) {}
    }
    pthread_mutex_unlock(&k->lock);
    return NULL;
}

static void keeper_free(struct ss_keeper *k) {
    free(k->lock_path);
    free(k->counters_path);
    free(k);
}

ss_keeper_t *ss_keeper_start(const ss_keeper_params_t *params) {
    if (params->interval_ns <= 0) {
        errno = EINVAL;
        return NULL;
    }
    struct ss_keeper *k = calloc(1, sizeof *k);
    if (k == NULL) return NULL;
    k->p = *params;
    k->lock_path = strdup(params->lock_path);
    k->counters_path = strdup(params->counters_path);
    if (k->lock_path == NULL || k->counters_path == NULL) {
        keeper_free(k);
        errno = ENOMEM;
        return NULL;
    }
    k->p.lock_path = k->lock_path;
    k->p.counters_path = k->counters_path;
    pthread_condattr_t attributes;
    pthread_condattr_init(&attributes);
    pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC);
    pthread_cond_init(&k->stop_changed, &attributes);
    pthread_condattr_destroy(&attributes);
    pthread_mutex_init(&k->lock, NULL);
    /* The thread takes no signal: they stay the application's (Python's main thread).  A
     * fault of its own still gets the process's handlers (faulthandler's traceback). */
    sigset_t blocked, previous;
    sigfillset(&blocked);
    sigdelset(&blocked, SIGSEGV);
    sigdelset(&blocked, SIGBUS);
    sigdelset(&blocked, SIGFPE);
    sigdelset(&blocked, SIGILL);
    pthread_sigmask(SIG_SETMASK, &blocked, &previous);
    int error = pthread_create(&k->thread, NULL, keeper_run, k);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (error == 0) pthread_setname_np(k->thread, "ss-keepalive");  /* as top -H shows it */
    if (error != 0) {
        pthread_cond_destroy(&k->stop_changed);
        pthread_mutex_destroy(&k->lock);
        keeper_free(k);
        errno = error;
        return NULL;
    }
    return k;
}

void ss_keeper_stop(ss_keeper_t *keeper) {
    if (keeper == NULL) return;
    pthread_mutex_lock(&keeper->lock);
    keeper->stop = 1;
    pthread_cond_signal(&keeper->stop_changed);
    pthread_mutex_unlock(&keeper->lock);
    pthread_join(keeper->thread, NULL);
    pthread_cond_destroy(&keeper->stop_changed);
    pthread_mutex_destroy(&keeper->lock);
    keeper_free(keeper);
}
