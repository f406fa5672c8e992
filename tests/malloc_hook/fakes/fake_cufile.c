/* Fake cuFile for the hook's CPU tests (built as libcufile.so.0, linked to the fake runtime).
 *
 * Registration state goes to the fake runtime (fake_note_*). Environment knobs, read at each
 * call: FAKE_CUFILE_REGISTER_ERROR / FAKE_CUFILE_DEREGISTER_ERROR / FAKE_CUFILE_OPEN_ERROR make
 * that call return the given CUfileOpError; FAKE_CUFILE_REENTER=1 makes cuFileBufRegister call
 * cudaMalloc and cudaFree itself, as a cuFile that needs scratch memory would. */
#include <stddef.h>
#include <stdatomic.h>
#include <stdlib.h>

struct cufile_error {
    int err;
    int cu_err;
};

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
void fake_note_register(const void *ptr, size_t size);
void fake_note_deregister(const void *ptr);

static atomic_int num_driver_opens;

static int error_from(const char *name) {
    const char *value = getenv(name);
    return value != NULL ? atoi(value) : 0;
}

struct cufile_error cuFileDriverOpen(void) {
    atomic_fetch_add(&num_driver_opens, 1);
    struct cufile_error result = {error_from("FAKE_CUFILE_OPEN_ERROR"), 0};
    return result;
}

struct cufile_error cuFileBufRegister(const void *ptr, size_t length, int flags) {
    (void)flags;
    struct cufile_error result = {error_from("FAKE_CUFILE_REGISTER_ERROR"), 0};
    if (error_from("FAKE_CUFILE_REENTER")) {
        void *scratch = NULL;
        if (cudaMalloc(&scratch, length) != 0 || cudaFree(scratch) != 0) {
            result.err = 5030; /* CU_FILE_INTERNAL_ERROR */
        }
    }
    if (result.err == 0) {
        fake_note_register(ptr, length);
    }
    return result;
}

struct cufile_error cuFileBufDeregister(const void *ptr) {
    struct cufile_error result = {error_from("FAKE_CUFILE_DEREGISTER_ERROR"), 0};
    if (result.err == 0) {
        fake_note_deregister(ptr);
    }
    return result;
}

int fake_cufile_num_driver_opens(void) { return atomic_load(&num_driver_opens); }
