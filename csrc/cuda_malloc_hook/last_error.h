/* The hook's last-error message: the library never prints, so this is how it reports. */
#ifndef TBA_HOOK_LAST_ERROR_H
#define TBA_HOOK_LAST_ERROR_H

#include <stddef.h>

/* Replaces the last-error message (printf format). Thread-safe; used on failure paths only. */
void tba_error_set(const char *format, ...) __attribute__((format(printf, 1, 2)));

/* Copies the message into buf (NUL-terminated, truncated to fit); returns its full length. */
size_t tba_error_copy(char *buf, size_t buf_size);

#endif
