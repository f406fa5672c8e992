#include "last_error.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t error_lock = PTHREAD_MUTEX_INITIALIZER;
static char error_message[512];

void tba_error_set(const char *format, ...) {
    va_list args;
    va_start(args, format);
    pthread_mutex_lock(&error_lock);
    vsnprintf(error_message, sizeof error_message, format, args);
    pthread_mutex_unlock(&error_lock);
    va_end(args);
}

size_t tba_error_copy(char *buf, size_t buf_size) {
    pthread_mutex_lock(&error_lock);
    size_t length = strlen(error_message);
    if (buf != NULL && buf_size > 0) {
        size_t n = length < buf_size - 1 ? length : buf_size - 1;
        memcpy(buf, error_message, n);
        buf[n] = '\0';
    }
    pthread_mutex_unlock(&error_lock);
    return length;
}
