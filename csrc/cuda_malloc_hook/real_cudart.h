/* The real cudaMalloc and cudaFree, found at run time (the hook links no CUDA). */
#ifndef TBA_HOOK_REAL_CUDART_H
#define TBA_HOOK_REAL_CUDART_H

#include <stddef.h>

/* cudaError_t is a C enum: int-sized. */
typedef int tba_cuda_error;
#define TBA_CUDA_SUCCESS 0
#define TBA_CUDA_ERROR_INITIALIZATION 3

typedef tba_cuda_error (*tba_cuda_malloc_fn)(void **ptr, size_t size);
typedef tba_cuda_error (*tba_cuda_free_fn)(void *ptr);

/* The next definition of cudaMalloc / cudaFree after the hook's own, or NULL (last error set)
 * when no CUDA runtime is loaded. A failed lookup is retried at the next call. */
tba_cuda_malloc_fn tba_real_cuda_malloc(void);
tba_cuda_free_fn tba_real_cuda_free(void);

/* 1 when the calling thread's cudaMalloc may be part of a CUDA graph capture, so nothing may be
 * registered now (Note [No registration while capturing] in real_cudart.c); 0 otherwise, also
 * when the runtime lacks the capture queries. */
int tba_cuda_may_be_capturing(void);

#endif
