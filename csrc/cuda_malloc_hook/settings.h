/* TBA_HOOK_* environment variables, read once, at the hook's first use (never at load). */
#ifndef TBA_HOOK_SETTINGS_H
#define TBA_HOOK_SETTINGS_H

#include <limits.h>
#include <stddef.h>

#define TBA_HOOK_DEFAULT_MIN_BYTES ((size_t)4 << 20)
#define TBA_HOOK_DEFAULT_MAX_SEGMENTS ((size_t)65536)
#define TBA_HOOK_LIMIT_MAX_SEGMENTS ((size_t)1 << 24)

/* TBA_HOOK_REGISTER: which allocations are registered. */
enum tba_register_mode {
    TBA_REGISTER_ALL = 0, /* every allocation of at least min_bytes */
    TBA_REGISTER_TBA = 1, /* only those made by a thread that tba tagged (its reload buffers) */
};

struct tba_hook_settings {
    int enabled;                     /* TBA_HOOK_ENABLED, default 1 */
    int register_mode;               /* TBA_HOOK_REGISTER, default all */
    size_t min_bytes;                /* TBA_HOOK_MIN_BYTES, default 4 MiB */
    size_t max_segments;             /* TBA_HOOK_MAX_SEGMENTS, default 65536 */
    char cufile_library[PATH_MAX];   /* TBA_HOOK_CUFILE_LIBRARY, "" = default sonames */
};

/* Fills *out from the environment. An invalid value keeps the default and is reported
 * through the last-error message. */
void tba_settings_read(struct tba_hook_settings *out);

#endif
