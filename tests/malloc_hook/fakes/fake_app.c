/* Stand-in for PyTorch's CUDA allocator in the hook's CPU tests: it calls cudaMalloc and
 * cudaFree through its PLT, linked against the fake runtime, exactly as libc10_cuda.so calls the
 * real one; under LD_PRELOAD those calls bind to the hook. */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

int app_malloc(void **ptr, size_t size) { return cudaMalloc(ptr, size); }

int app_free(void *ptr) { return cudaFree(ptr); }

int cudaThreadExchangeStreamCaptureMode(int *mode);

/* What PyTorch's allocator does for a cudaMalloc during a graph capture: switch the thread's
 * capture mode to relaxed around it (CUDAStreamCaptureModeGuard). */
int app_malloc_capturing(void **ptr, size_t size) {
    int mode = 2;
    cudaThreadExchangeStreamCaptureMode(&mode);
    int status = cudaMalloc(ptr, size);
    cudaThreadExchangeStreamCaptureMode(&mode);
    return status;
}

struct stress {
    int num_iterations;
    size_t small_bytes;
    size_t large_bytes;
    atomic_int num_errors;
    pthread_barrier_t start;
};

static void *stress_thread(void *arg) {
    struct stress *stress = arg;
    pthread_barrier_wait(&stress->start);
    for (int i = 0; i < stress->num_iterations; ++i) {
        size_t size = i % 2 == 0 ? stress->large_bytes : stress->small_bytes;
        void *ptr = NULL;
        if (cudaMalloc(&ptr, size) != 0 || ptr == NULL) {
            atomic_fetch_add(&stress->num_errors, 1);
            continue;
        }
        memset(ptr, 0x5a, 8);
        if (cudaFree(ptr) != 0) {
            atomic_fetch_add(&stress->num_errors, 1);
        }
    }
    return NULL;
}

/* num_threads threads, each doing num_iterations cudaMalloc/cudaFree pairs alternating
 * large_bytes and small_bytes, released together. Returns the number of failed calls, or -1. */
int app_stress(int num_threads, int num_iterations, size_t small_bytes, size_t large_bytes) {
    pthread_t threads[64];
    if (num_threads < 1 || num_threads > 64 || small_bytes < 8 || large_bytes < 8) {
        return -1;
    }
    struct stress stress = {num_iterations, small_bytes, large_bytes, 0, {{0}}};
    atomic_init(&stress.num_errors, 0);
    pthread_barrier_init(&stress.start, NULL, (unsigned)num_threads);
    for (int t = 0; t < num_threads; ++t) {
        pthread_create(&threads[t], NULL, stress_thread, &stress);
    }
    for (int t = 0; t < num_threads; ++t) {
        pthread_join(threads[t], NULL);
    }
    pthread_barrier_destroy(&stress.start);
    return atomic_load(&stress.num_errors);
}
