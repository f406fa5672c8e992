#include "real_cudart.h"

#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdatomic.h>
#include <string.h>

#include "last_error.h"
#include "tba_cuda_malloc_hook.h"

static _Atomic(tba_cuda_malloc_fn) real_malloc;
static _Atomic(tba_cuda_free_fn) real_free;

struct cudart_search {
    char path[PATH_MAX];
    int found;
};

static int find_cudart(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct cudart_search *search = data;
    const char *name = info->dlpi_name;
    if (name == NULL || name[0] == '\0') {
        return 0;
    }
    const char *base = strrchr(name, '/');
    base = base != NULL ? base + 1 : name;
    if (strncmp(base, "libcudart", strlen("libcudart")) != 0 || strlen(name) >= PATH_MAX) {
        return 0;
    }
    strcpy(search->path, name);
    search->found = 1;
    return 1;
}

/* Note [Finding the real runtime]: RTLD_NEXT sees only the libraries of the global scope (the
 * executable's dependencies and RTLD_GLOBAL dlopens). A CUDA runtime pulled in by an extension
 * module that Python loaded with RTLD_LOCAL is outside it, yet its callers still bind to the
 * hook's definitions because the preloaded hook comes first in their lookup scope. So when
 * RTLD_NEXT finds nothing, look for a loaded libcudart* by name and ask it directly. The
 * handle is kept open so the runtime cannot be unloaded under a cached pointer. */
static void *resolve(const char *symbol, void *own_definition, int quiet) {
    void *found = dlsym(RTLD_NEXT, symbol);
    if (found != NULL && found != own_definition) {
        return found;
    }
    struct cudart_search search = {.found = 0};
    /* dlopen must not run inside the dl_iterate_phdr callback (loader lock): copy the name. */
    dl_iterate_phdr(find_cudart, &search);
    if (search.found) {
        void *handle = dlopen(search.path, RTLD_LAZY | RTLD_NOLOAD);
        if (handle != NULL) {
            found = dlsym(handle, symbol);
            if (found != NULL && found != own_definition) {
                return found;
            }
            dlclose(handle);
        }
    }
    if (!quiet) {
        tba_error_set("no CUDA runtime library defining %s is loaded in this process", symbol);
    }
    return NULL;
}

tba_cuda_malloc_fn tba_real_cuda_malloc(void) {
    tba_cuda_malloc_fn fn = atomic_load_explicit(&real_malloc, memory_order_acquire);
    if (fn == NULL) {
        /* POSIX guarantees that object and function pointers convert through void *. */
        fn = (tba_cuda_malloc_fn)resolve("cudaMalloc", (void *)cudaMalloc, 0);
        atomic_store_explicit(&real_malloc, fn, memory_order_release);
    }
    return fn;
}

tba_cuda_free_fn tba_real_cuda_free(void) {
    tba_cuda_free_fn fn = atomic_load_explicit(&real_free, memory_order_acquire);
    if (fn == NULL) {
        fn = (tba_cuda_free_fn)resolve("cudaFree", (void *)cudaFree, 0);
        atomic_store_explicit(&real_free, fn, memory_order_release);
    }
    return fn;
}

/* Note [No registration while capturing]: cuFileBufRegister makes driver calls that a CUDA
 * graph capture in global mode forbids (from any thread: the capture is invalidated), and the
 * segment belongs to the graph's private pool anyway. The hook cannot see which stream is
 * capturing, but PyTorch's allocator tells: it calls cudaMalloc during a capture only with the
 * calling thread's capture mode switched to relaxed (CUDAStreamCaptureModeGuard), and outside
 * a capture with the default (global) mode; NCCL does the same around its own allocations.
 * The legacy stream also reports a capture on a blocking stream of the device
 * (cudaErrorStreamCaptureImplicit). Both queries are capture-safe; an error they leave in the
 * thread's last-error slot is cleared, so PyTorch's next launch check does not see it. */
typedef tba_cuda_error (*exchange_mode_fn)(int *mode);
typedef tba_cuda_error (*is_capturing_fn)(void *stream, int *status);
typedef tba_cuda_error (*get_last_error_fn)(void);

#define TBA_CAPTURE_MODE_RELAXED 2
#define TBA_CAPTURE_STATUS_NONE 0
#define TBA_CUDA_ERROR_STREAM_CAPTURE_IMPLICIT 906
#define TBA_CUDA_STREAM_LEGACY ((void *)0x1)

static atomic_int capture_api_resolved;
static _Atomic(exchange_mode_fn) exchange_mode;
static _Atomic(is_capturing_fn) is_capturing;
static _Atomic(get_last_error_fn) get_last_error;

static void resolve_capture_api(void) {
    if (atomic_load_explicit(&capture_api_resolved, memory_order_acquire)) {
        return;
    }
    /* Racing threads resolve the same symbols: harmless. */
    atomic_store(&exchange_mode,
                 (exchange_mode_fn)resolve("cudaThreadExchangeStreamCaptureMode", NULL, 1));
    atomic_store(&is_capturing, (is_capturing_fn)resolve("cudaStreamIsCapturing", NULL, 1));
    atomic_store(&get_last_error, (get_last_error_fn)resolve("cudaGetLastError", NULL, 1));
    atomic_store_explicit(&capture_api_resolved, 1, memory_order_release);
}

int tba_cuda_may_be_capturing(void) {
    resolve_capture_api();
    exchange_mode_fn exchange = atomic_load(&exchange_mode);
    if (exchange != NULL) {
        int mode = TBA_CAPTURE_MODE_RELAXED;
        if (exchange(&mode) == TBA_CUDA_SUCCESS) {
            int restore = mode;
            exchange(&restore);
            if (mode == TBA_CAPTURE_MODE_RELAXED) {
                return 1;
            }
        }
    }
    is_capturing_fn query = atomic_load(&is_capturing);
    if (query != NULL) {
        int status = TBA_CAPTURE_STATUS_NONE;
        tba_cuda_error error = query(TBA_CUDA_STREAM_LEGACY, &status);
        if (error != TBA_CUDA_SUCCESS) {
            get_last_error_fn clear = atomic_load(&get_last_error);
            if (clear != NULL) {
                clear();
            }
            return error == TBA_CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        }
        return status != TBA_CAPTURE_STATUS_NONE;
    }
    return 0;
}
