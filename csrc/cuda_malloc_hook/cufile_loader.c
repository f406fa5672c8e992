#include "cufile_loader.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "last_error.h"
#include "tba_cuda_malloc_hook.h"

#define CU_FILE_DRIVER_ALREADY_OPEN 5026

typedef struct tba_cufile_error (*cufile_driver_open_fn)(void);

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int state = TBA_CUFILE_NOT_LOADED;
static struct tba_cufile_api api;
static char broken_reason[384]; /* written once, under load_lock, before state = BROKEN */

static const struct {
    int err;
    const char *name;
} error_names[] = {
    {5001, "CU_FILE_DRIVER_NOT_INITIALIZED"},  {5004, "CU_FILE_DRIVER_VERSION_MISMATCH"},
    {5006, "CU_FILE_DRIVER_CLOSING"},          {5007, "CU_FILE_PLATFORM_NOT_SUPPORTED"},
    {5009, "CU_FILE_DEVICE_NOT_SUPPORTED"},    {5010, "CU_FILE_NVFS_DRIVER_ERROR"},
    {5011, "CU_FILE_CUDA_DRIVER_ERROR"},       {5012, "CU_FILE_CUDA_POINTER_INVALID"},
    {5013, "CU_FILE_CUDA_MEMORY_TYPE_INVALID"}, {5014, "CU_FILE_CUDA_POINTER_RANGE_ERROR"},
    {5015, "CU_FILE_CUDA_CONTEXT_MISMATCH"},   {5016, "CU_FILE_INVALID_MAPPING_SIZE"},
    {5022, "CU_FILE_INVALID_VALUE"},           {5023, "CU_FILE_MEMORY_ALREADY_REGISTERED"},
    {5024, "CU_FILE_MEMORY_NOT_REGISTERED"},   {5025, "CU_FILE_PERMISSION_DENIED"},
    {5026, "CU_FILE_DRIVER_ALREADY_OPEN"},     {5029, "CU_FILE_DEVICE_NOT_FOUND"},
    {5030, "CU_FILE_INTERNAL_ERROR"},          {5036, "CU_FILE_GPU_MEMORY_PINNING_FAILED"},
    {5043, "CU_FILE_NOMEM_ERROR"},             {5045, "CU_FILE_INTERNAL_BUF_REGISTER_ERROR"},
};

const char *tba_cufile_error_name(int err) {
    err = abs(err);
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; ++i) {
        if (error_names[i].err == err) {
            return error_names[i].name;
        }
    }
    return "unknown";
}

int tba_cufile_state(void) { return atomic_load(&state); }

static void *open_library(const char *library) {
    if (library != NULL && library[0] != '\0') {
        void *handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
        if (handle == NULL) {
            const char *why = dlerror();
            tba_error_set("cannot load cuFile from TBA_HOOK_CUFILE_LIBRARY=%s: %s", library,
                          why != NULL ? why : "unknown dlopen error");
        }
        return handle;
    }
    void *handle = dlopen("libcufile.so.0", RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        handle = dlopen("libcufile.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (handle == NULL) {
        tba_error_set("cannot load cuFile: libcufile.so.0 is neither loaded nor on the library "
                      "search path; set TBA_HOOK_CUFILE_LIBRARY to its path "
                      "(`python -m tba.malloc_hook --env` prints it)");
    }
    return handle;
}

/* Sets state BROKEN with a reason that later calls repeat. Called with load_lock held. */
static void mark_broken(const char *what, int err, int cu_err) {
    if (err != 0) {
        snprintf(broken_reason, sizeof broken_reason,
                 "%s: cuFile error %d (%s), CUDA driver error %d", what, err,
                 tba_cufile_error_name(err), cu_err);
    } else {
        snprintf(broken_reason, sizeof broken_reason, "%s", what);
    }
    tba_error_set("%s", broken_reason);
    atomic_store(&state, TBA_CUFILE_BROKEN);
}

static void load(const char *library) {
    void *handle = open_library(library);
    if (handle == NULL) {
        atomic_store(&state, TBA_CUFILE_MISSING);
        return;
    }
    struct tba_cufile_api loaded;
    loaded.buf_register = (tba_cufile_buf_register_fn)dlsym(handle, "cuFileBufRegister");
    loaded.buf_deregister = (tba_cufile_buf_deregister_fn)dlsym(handle, "cuFileBufDeregister");
    cufile_driver_open_fn driver_open = (cufile_driver_open_fn)dlsym(handle, "cuFileDriverOpen");
    if (loaded.buf_register == NULL || loaded.buf_deregister == NULL || driver_open == NULL) {
        mark_broken("the loaded cuFile library lacks cuFileBufRegister, cuFileBufDeregister or "
                    "cuFileDriverOpen",
                    0, 0);
        return;
    }
    /* Note [Driver reference]: cuFile counts driver opens (cuFileUseCount); the hook keeps one
     * for the life of the process so registrations survive kvikio closing its own. */
    struct tba_cufile_error opened = driver_open();
    if (opened.err != 0 && abs(opened.err) != CU_FILE_DRIVER_ALREADY_OPEN) {
        mark_broken("cuFileDriverOpen failed", opened.err, opened.cu_err);
        return;
    }
    api = loaded;
    atomic_store(&state, TBA_CUFILE_READY);
}

const struct tba_cufile_api *tba_cufile_acquire(const char *library) {
    if (atomic_load(&state) == TBA_CUFILE_READY) {
        return &api;
    }
    pthread_mutex_lock(&load_lock);
    int current = atomic_load(&state);
    if (current == TBA_CUFILE_NOT_LOADED || current == TBA_CUFILE_MISSING) {
        load(library);
        current = atomic_load(&state);
    } else if (current == TBA_CUFILE_BROKEN) {
        tba_error_set("%s", broken_reason);
    }
    pthread_mutex_unlock(&load_lock);
    return current == TBA_CUFILE_READY ? &api : NULL;
}
