/*
 * Public interface of libtba_cuda_malloc_hook.so, the LD_PRELOAD library that registers the
 * CUDA allocations of a process with cuFile (GPUDirect Storage).
 *
 * The library exports exactly these symbols: the two interposed CUDA runtime functions
 * (cudaMalloc, cudaFree) and the tba_hook_* control functions below. Everything else has hidden
 * visibility so that nothing else in a process can bind to it by accident.
 *
 * tba/malloc_hook/_status.py mirrors struct tba_hook_status with ctypes: change both together.
 */
#ifndef TBA_CUDA_MALLOC_HOOK_H
#define TBA_CUDA_MALLOC_HOOK_H

#include <stddef.h>
#include <stdint.h>

#define TBA_HOOK_EXPORT __attribute__((visibility("default")))

/* State of the lazily loaded cuFile library (field cufile_state). */
enum tba_cufile_state {
    TBA_CUFILE_NOT_LOADED = 0, /* no allocation large enough to register was seen yet */
    TBA_CUFILE_READY = 1,      /* loaded, symbols resolved, driver opened */
    TBA_CUFILE_MISSING = 2,    /* dlopen failed; retried at the next large allocation */
    TBA_CUFILE_BROKEN = 3,     /* loaded but unusable (symbols or driver open); not retried */
};

/* Every field is 64 bits wide so the layout has no padding. Counters only grow, except
 * num_live_registered and registered_bytes, which describe the allocations registered now. */
struct tba_hook_status {
    uint64_t enabled;               /* registration of new allocations is switched on */
    uint64_t min_bytes;             /* allocations of at least this size are registered */
    uint64_t max_segments;          /* capacity of the registry of live registrations */
    uint64_t num_allocations;       /* successful cudaMalloc calls seen */
    uint64_t num_frees;             /* cudaFree calls seen with a non-NULL pointer */
    uint64_t num_registered;        /* successful cuFileBufRegister calls */
    uint64_t num_deregistered;      /* cuFileBufDeregister calls made before a free */
    uint64_t num_failed;            /* allocations >= min_bytes left unregistered */
    uint64_t num_deregister_failed; /* cuFileBufDeregister calls that returned an error */
    uint64_t num_live_registered;   /* registered allocations not freed yet */
    uint64_t registered_bytes;      /* bytes of the registered allocations not freed yet */
    int64_t cufile_state;           /* enum tba_cufile_state */
    uint64_t register_mode;         /* TBA_HOOK_REGISTER: 0 = all, 1 = tba (tagged only) */
    uint64_t num_skipped_capturing; /* allocations left unregistered: made during a capture */
    uint64_t num_skipped_untagged;  /* allocations left unregistered: not tagged (mode tba) */
};

/* The interposed CUDA runtime functions (cudaError_t is an int-sized enum). They call the real
 * ones and register / deregister with cuFile around them; see hook.c. */
TBA_HOOK_EXPORT int cudaMalloc(void **ptr, size_t size);
TBA_HOOK_EXPORT int cudaFree(void *ptr);

/* Fills *out. Returns 0, or -1 when out_size != sizeof(struct tba_hook_status) (the caller
 * was built against another version of this header). */
TBA_HOOK_EXPORT int tba_hook_get_status(struct tba_hook_status *out, size_t out_size);

/* Switches registration of new allocations on (enabled != 0) or off, and returns the previous
 * setting. Allocations registered earlier are still deregistered when they are freed. */
TBA_HOOK_EXPORT int tba_hook_set_enabled(int enabled);

/* Tags (on != 0) or untags the allocations the calling thread makes from now on and returns the
 * previous setting. With TBA_HOOK_REGISTER=tba only tagged allocations are registered. */
TBA_HOOK_EXPORT int tba_hook_set_thread_tagged(int on);

/* Copies the most recent error message (NUL-terminated, truncated to fit) into buf and returns
 * its full length; 0 when no error happened. */
TBA_HOOK_EXPORT size_t tba_hook_last_error(char *buf, size_t buf_size);

#endif /* TBA_CUDA_MALLOC_HOOK_H */
