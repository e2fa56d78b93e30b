/* Shift this process's wall clock (CLOCK_REALTIME) by CLOCK_SHIFT_S seconds, as a host whose clock is off
 * would have it. Loaded with LD_PRELOAD by bench/cluster_harness.py for the hosts it is asked to skew; the
 * monotonic clocks, and the file times the kernel sets, stay true (as a shared mount's server would set them).
 * A test tool, not part of the server. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long shift_ns(void) {
    static long long shift = 0;
    static int read = 0;
    if (!read) {
        const char *s = getenv("CLOCK_SHIFT_S");
        shift = s ? (long long)(atof(s) * 1e9) : 0;
        read = 1;
    }
    return shift;
}

static void shift_timespec(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_ns();
    ts->tv_sec = (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000L;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *) = NULL;
    if (real == NULL)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        shift_timespec(ts);
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    (void)tz;
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
