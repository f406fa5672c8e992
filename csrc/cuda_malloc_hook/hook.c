/* cudaMalloc / cudaFree interposition: register each large enough CUDA allocation with cuFile
 * after the real cudaMalloc, deregister it before the real cudaFree.
 *
 * Note [Registration order]
 *   malloc: real cudaMalloc -> cuFileBufRegister -> registry insert.
 *   free:   registry remove -> cuFileBufDeregister -> real cudaFree.
 * So a pointer is in the registry only while it is registered, and is deregistered exactly once,
 * strictly before the memory goes back to CUDA (where the next cudaMalloc may hand it out again).
 * The registry lock is never held while calling cuFile or CUDA, and calls that cuFile itself
 * makes into cudaMalloc / cudaFree (inside_cufile) pass straight through: no recursion, and no
 * lock-order cycle with cuFile's internal locks. Tested by tests/malloc_hook/test_hook.py.
 *
 * Which allocations: at least TBA_HOOK_MIN_BYTES, only tagged ones with TBA_HOOK_REGISTER=tba
 * (Note [Tagged allocations]), never during a CUDA graph capture (Note [No registration while
 * capturing], real_cudart.c). Registration runs inside PyTorch's cudaMalloc, that is under its
 * allocator's lock: the tba mode keeps those calls to the few segments GDS actually reads.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "cufile_loader.h"
#include "last_error.h"
#include "real_cudart.h"
#include "registry.h"
#include "settings.h"
#include "tba_cuda_malloc_hook.h"

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static struct tba_hook_settings settings;
static struct tba_registry registry;
static atomic_int enabled;
static atomic_uint_fast64_t num_allocations;
static atomic_uint_fast64_t num_frees;
static atomic_uint_fast64_t num_registered;
static atomic_uint_fast64_t num_deregistered;
static atomic_uint_fast64_t num_failed;
static atomic_uint_fast64_t num_deregister_failed;
static atomic_uint_fast64_t num_skipped_capturing;
static atomic_uint_fast64_t num_skipped_untagged;
static _Thread_local int inside_cufile;
/* Note [Tagged allocations]: with TBA_HOOK_REGISTER=tba only segments that PyTorch's caching
 * allocator cudaMallocs while a tba thread has switched its tag on are registered. PyTorch
 * calls cudaMalloc synchronously on the thread that asked for the tensor, so tba tags the
 * thread around the allocation of a reload buffer (tba.malloc_hook.tagged_allocations()) and
 * the segment that buffer lands in, if it is a new one, is registered; weights, optimizer
 * state and NCCL buffers are not. A reload buffer carved from a segment that already existed
 * stays unregistered (GDS then moves it through a bounce buffer: slower, still correct). */
static _Thread_local int thread_tagged;

static void init(void) {
    tba_settings_read(&settings);
    atomic_store(&enabled, settings.enabled);
    if (tba_registry_init(&registry, settings.max_segments) != 0) {
        tba_error_set("cannot allocate the registry for TBA_HOOK_MAX_SEGMENTS=%zu entries; "
                      "nothing will be registered",
                      settings.max_segments);
    }
}

/* Settings are read at first use, never when the library is loaded. */
static void ensure_init(void) { pthread_once(&init_once, init); }

static void fail_registration(void) { atomic_fetch_add(&num_failed, 1); }

static void register_allocation(void *ptr, size_t size) {
    if (atomic_load(&registry.count) >= registry.capacity) {
        fail_registration();
        tba_error_set("cannot register %p (%zu bytes): %zu allocations are registered already, "
                      "the limit; raise TBA_HOOK_MAX_SEGMENTS",
                      ptr, size, registry.capacity);
        return;
    }
    const struct tba_cufile_api *cufile = tba_cufile_acquire(settings.cufile_library);
    if (cufile == NULL) {
        fail_registration();
        return;
    }
    inside_cufile = 1;
    struct tba_cufile_error result = cufile->buf_register(ptr, size, 0);
    inside_cufile = 0;
    if (result.err != 0) {
        fail_registration();
        tba_error_set("cuFileBufRegister(%p, %zu bytes) failed: cuFile error %d (%s), CUDA "
                      "driver error %d",
                      ptr, size, result.err, tba_cufile_error_name(result.err), result.cu_err);
        return;
    }
    size_t old_size = 0;
    switch (tba_registry_insert(&registry, (uintptr_t)ptr, size, &old_size)) {
    case TBA_REGISTRY_INSERTED:
        atomic_fetch_add(&num_registered, 1);
        break;
    case TBA_REGISTRY_REPLACED:
        atomic_fetch_add(&num_registered, 1);
        tba_error_set("%p (%zu bytes) was registered while a registration of %zu bytes at the "
                      "same address was live: memory was freed without going through cudaFree",
                      ptr, size, old_size);
        break;
    case TBA_REGISTRY_FULL:
        /* Lost a race for the last slot: undo, since an untracked registration would never be
         * deregistered. */
        inside_cufile = 1;
        cufile->buf_deregister(ptr);
        inside_cufile = 0;
        fail_registration();
        tba_error_set("cannot register %p (%zu bytes): %zu allocations are registered already, "
                      "the limit; raise TBA_HOOK_MAX_SEGMENTS",
                      ptr, size, registry.capacity);
        break;
    }
}

static void deregister_allocation(void *ptr, size_t size) {
    /* Registered implies cuFile is READY: this returns at once. */
    const struct tba_cufile_api *cufile = tba_cufile_acquire(settings.cufile_library);
    if (cufile == NULL) {
        return;
    }
    inside_cufile = 1;
    struct tba_cufile_error result = cufile->buf_deregister(ptr);
    inside_cufile = 0;
    atomic_fetch_add(&num_deregistered, 1);
    if (result.err != 0) {
        atomic_fetch_add(&num_deregister_failed, 1);
        tba_error_set("cuFileBufDeregister(%p) of %zu bytes failed: cuFile error %d (%s), CUDA "
                      "driver error %d; freeing it anyway",
                      ptr, size, result.err, tba_cufile_error_name(result.err), result.cu_err);
    }
}

TBA_HOOK_EXPORT int cudaMalloc(void **ptr, size_t size) {
    ensure_init();
    tba_cuda_malloc_fn real = tba_real_cuda_malloc();
    if (real == NULL) {
        return TBA_CUDA_ERROR_INITIALIZATION;
    }
    tba_cuda_error status = real(ptr, size);
    if (status != TBA_CUDA_SUCCESS || ptr == NULL || *ptr == NULL) {
        return status;
    }
    atomic_fetch_add(&num_allocations, 1);
    if (!inside_cufile && size >= settings.min_bytes && atomic_load(&enabled)) {
        if (settings.register_mode == TBA_REGISTER_TBA && !thread_tagged) {
            atomic_fetch_add(&num_skipped_untagged, 1);
        } else if (tba_cuda_may_be_capturing()) {
            /* Note [No registration while capturing] (real_cudart.c). */
            atomic_fetch_add(&num_skipped_capturing, 1);
        } else {
            register_allocation(*ptr, size);
        }
    }
    return status;
}

TBA_HOOK_EXPORT int cudaFree(void *ptr) {
    ensure_init();
    tba_cuda_free_fn real = tba_real_cuda_free();
    if (real == NULL) {
        return TBA_CUDA_ERROR_INITIALIZATION;
    }
    if (ptr != NULL) {
        atomic_fetch_add(&num_frees, 1);
        size_t size = 0;
        /* Even when disabled: what was registered earlier must still be deregistered. */
        if (!inside_cufile && atomic_load(&registry.count) > 0 &&
            tba_registry_remove(&registry, (uintptr_t)ptr, &size)) {
            deregister_allocation(ptr, size);
        }
    }
    return real(ptr);
}

TBA_HOOK_EXPORT int tba_hook_get_status(struct tba_hook_status *out, size_t out_size) {
    if (out == NULL || out_size != sizeof *out) {
        return -1;
    }
    ensure_init();
    size_t live = 0;
    size_t live_bytes = 0;
    tba_registry_totals(&registry, &live, &live_bytes);
    memset(out, 0, sizeof *out);
    out->enabled = (uint64_t)atomic_load(&enabled);
    out->min_bytes = settings.min_bytes;
    out->max_segments = registry.capacity;
    out->num_allocations = atomic_load(&num_allocations);
    out->num_frees = atomic_load(&num_frees);
    out->num_registered = atomic_load(&num_registered);
    out->num_deregistered = atomic_load(&num_deregistered);
    out->num_failed = atomic_load(&num_failed);
    out->num_deregister_failed = atomic_load(&num_deregister_failed);
    out->num_live_registered = live;
    out->registered_bytes = live_bytes;
    out->cufile_state = tba_cufile_state();
    out->register_mode = (uint64_t)settings.register_mode;
    out->num_skipped_capturing = atomic_load(&num_skipped_capturing);
    out->num_skipped_untagged = atomic_load(&num_skipped_untagged);
    return 0;
}

TBA_HOOK_EXPORT int tba_hook_set_enabled(int on) {
    ensure_init();
    return atomic_exchange(&enabled, on != 0);
}

TBA_HOOK_EXPORT int tba_hook_set_thread_tagged(int on) {
    int previous = thread_tagged;
    thread_tagged = on != 0;
    return previous;
}

TBA_HOOK_EXPORT size_t tba_hook_last_error(char *buf, size_t buf_size) {
    return tba_error_copy(buf, buf_size);
}
