/* cuFile, loaded lazily with dlopen: the hook has no link-time CUDA or cuFile dependency, so it
 * declares the few cuFile types it uses itself (layouts as in cufile.h, which is not included). */
#ifndef TBA_HOOK_CUFILE_LOADER_H
#define TBA_HOOK_CUFILE_LOADER_H

#include <stddef.h>

/* CUfileError_t: a CUfileOpError and a CUresult, both C enums (int-sized). */
struct tba_cufile_error {
    int err;    /* CUfileOpError: 0 = CU_FILE_SUCCESS, 5000 + n otherwise */
    int cu_err; /* CUresult, set when err is CU_FILE_CUDA_DRIVER_ERROR */
};

typedef struct tba_cufile_error (*tba_cufile_buf_register_fn)(const void *ptr, size_t length,
                                                               int flags);
typedef struct tba_cufile_error (*tba_cufile_buf_deregister_fn)(const void *ptr);

struct tba_cufile_api {
    tba_cufile_buf_register_fn buf_register;
    tba_cufile_buf_deregister_fn buf_deregister;
};

/* The loaded API, loading it on first use: dlopen `library` (a path or soname; NULL or "" tries
 * libcufile.so.0 then libcufile.so), resolve the symbols, cuFileDriverOpen once. Returns NULL
 * and sets the last error when cuFile is unusable; a failed dlopen is retried at the next call,
 * a library that loads but cannot be used is not. Must not be called with the registry lock. */
const struct tba_cufile_api *tba_cufile_acquire(const char *library);

/* enum tba_cufile_state (tba_cuda_malloc_hook.h). */
int tba_cufile_state(void);

/* Name of a CUfileOpError code, e.g. "CU_FILE_INVALID_VALUE"; "unknown" if not listed. */
const char *tba_cufile_error_name(int err);

#endif
