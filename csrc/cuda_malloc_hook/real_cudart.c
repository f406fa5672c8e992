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
static void *resolve(const char *symbol, void *own_definition) {
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
    tba_error_set("no CUDA runtime library defining %s is loaded in this process", symbol);
    return NULL;
}

tba_cuda_malloc_fn tba_real_cuda_malloc(void) {
    tba_cuda_malloc_fn fn = atomic_load_explicit(&real_malloc, memory_order_acquire);
    if (fn == NULL) {
        /* POSIX guarantees that object and function pointers convert through void *. */
        fn = (tba_cuda_malloc_fn)resolve("cudaMalloc", (void *)cudaMalloc);
        atomic_store_explicit(&real_malloc, fn, memory_order_release);
    }
    return fn;
}

tba_cuda_free_fn tba_real_cuda_free(void) {
    tba_cuda_free_fn fn = atomic_load_explicit(&real_free, memory_order_acquire);
    if (fn == NULL) {
        fn = (tba_cuda_free_fn)resolve("cudaFree", (void *)cudaFree);
        atomic_store_explicit(&real_free, fn, memory_order_release);
    }
    return fn;
}
