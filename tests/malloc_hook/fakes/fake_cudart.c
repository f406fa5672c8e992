/* Fake CUDA runtime for the hook's CPU tests (built as libcudart.so.13 by the test suite).
 *
 * cudaMalloc hands out host memory. The fake also keeps the ground truth the tests check: which
 * pointers fake cuFile holds registered (fake_cufile.c reports to it), an ordered event log
 * (M malloc, R register, D deregister, F free), and violation counters, above all a pointer
 * freed while still registered.
 *
 * Graph capture, as the hook sees it (Note [No registration while capturing]): the calling
 * thread's capture mode (cudaThreadExchangeStreamCaptureMode; PyTorch switches it to relaxed
 * around a cudaMalloc during capture, see fake_app.c) and the legacy stream's capture status,
 * set by fake_set_legacy_capture: 0 none, 1 active, or 906 for the
 * cudaErrorStreamCaptureImplicit a capture on a blocking stream gives. An error returned here
 * stays in the thread's last-error slot until cudaGetLastError, as with the real runtime. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIVE_REGISTERED 16384
#define MAX_EVENTS 65536

struct fake_stats {
    uint64_t num_mallocs;
    uint64_t num_frees;
    uint64_t num_registers;
    uint64_t num_deregisters;
    uint64_t num_live_registered;
    uint64_t num_freed_while_registered;
    uint64_t num_double_registers;
    uint64_t num_unknown_deregisters;
    uint64_t num_events_dropped;
};

struct fake_event {
    uint64_t kind; /* 'M', 'R', 'D' or 'F' */
    uint64_t ptr;
    uint64_t size;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_stats stats;
static uintptr_t live_registered[MAX_LIVE_REGISTERED];
static struct fake_event events[MAX_EVENTS];
static size_t num_events;

/* All helpers below run with `lock` held. */
static void record(char kind, const void *ptr, size_t size) {
    if (num_events == MAX_EVENTS) {
        stats.num_events_dropped++;
        return;
    }
    events[num_events].kind = (uint64_t)kind;
    events[num_events].ptr = (uint64_t)(uintptr_t)ptr;
    events[num_events].size = size;
    num_events++;
}

static long find_registered(const void *ptr) {
    for (uint64_t i = 0; i < stats.num_live_registered; ++i) {
        if (live_registered[i] == (uintptr_t)ptr) {
            return (long)i;
        }
    }
    return -1;
}

static int legacy_capture;
static _Thread_local int thread_capture_mode; /* 0 global (the default), 1 thread local, 2 relaxed */
static _Thread_local int thread_last_error;

int cudaThreadExchangeStreamCaptureMode(int *mode) {
    int previous = thread_capture_mode;
    thread_capture_mode = *mode;
    *mode = previous;
    return 0;
}

int cudaStreamIsCapturing(void *stream, int *status) {
    if (stream != (void *)0x1) {
        *status = 0;
        return 0;
    }
    pthread_mutex_lock(&lock);
    int capture = legacy_capture;
    pthread_mutex_unlock(&lock);
    if (capture == 906) {
        thread_last_error = 906;
        return 906;
    }
    *status = capture;
    return 0;
}

int cudaGetLastError(void) {
    int error = thread_last_error;
    thread_last_error = 0;
    return error;
}

void fake_set_legacy_capture(int capture) {
    pthread_mutex_lock(&lock);
    legacy_capture = capture;
    pthread_mutex_unlock(&lock);
}

/* The calling thread's pending last error, without clearing it. */
int fake_peek_last_error(void) { return thread_last_error; }

int cudaMalloc(void **ptr, size_t size) {
    void *memory = malloc(size > 0 ? size : 1);
    if (memory == NULL) {
        return 2; /* cudaErrorMemoryAllocation */
    }
    pthread_mutex_lock(&lock);
    stats.num_mallocs++;
    record('M', memory, size);
    pthread_mutex_unlock(&lock);
    *ptr = memory;
    return 0;
}

int cudaFree(void *ptr) {
    if (ptr == NULL) {
        return 0;
    }
    pthread_mutex_lock(&lock);
    if (find_registered(ptr) >= 0) {
        stats.num_freed_while_registered++;
    }
    stats.num_frees++;
    record('F', ptr, 0);
    pthread_mutex_unlock(&lock);
    free(ptr);
    return 0;
}

void fake_note_register(const void *ptr, size_t size) {
    pthread_mutex_lock(&lock);
    stats.num_registers++;
    if (find_registered(ptr) >= 0) {
        stats.num_double_registers++;
    } else if (stats.num_live_registered < MAX_LIVE_REGISTERED) {
        live_registered[stats.num_live_registered++] = (uintptr_t)ptr;
    }
    record('R', ptr, size);
    pthread_mutex_unlock(&lock);
}

void fake_note_deregister(const void *ptr) {
    pthread_mutex_lock(&lock);
    stats.num_deregisters++;
    long i = find_registered(ptr);
    if (i < 0) {
        stats.num_unknown_deregisters++;
    } else {
        live_registered[i] = live_registered[--stats.num_live_registered];
    }
    record('D', ptr, 0);
    pthread_mutex_unlock(&lock);
}

void fake_get_stats(struct fake_stats *out) {
    pthread_mutex_lock(&lock);
    *out = stats;
    pthread_mutex_unlock(&lock);
}

size_t fake_get_events(struct fake_event *out, size_t capacity) {
    pthread_mutex_lock(&lock);
    size_t n = num_events < capacity ? num_events : capacity;
    memcpy(out, events, n * sizeof *out);
    pthread_mutex_unlock(&lock);
    return n;
}
