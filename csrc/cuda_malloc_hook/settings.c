#include "settings.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "last_error.h"

static void read_flag(const char *name, int *value) {
    const char *text = getenv(name);
    if (text == NULL || text[0] == '\0') {
        return;
    }
    static const char *const falses[] = {"0", "false", "no", "off"};
    static const char *const trues[] = {"1", "true", "yes", "on"};
    for (size_t i = 0; i < sizeof falses / sizeof falses[0]; ++i) {
        if (strcasecmp(text, falses[i]) == 0) {
            *value = 0;
            return;
        }
        if (strcasecmp(text, trues[i]) == 0) {
            *value = 1;
            return;
        }
    }
    tba_error_set("%s=%s is not a flag: expected 1/0, true/false, yes/no or on/off; using %d",
                  name, text, *value);
}

static void read_size(const char *name, size_t low, size_t high, size_t *value) {
    const char *text = getenv(name);
    if (text == NULL || text[0] == '\0') {
        return;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long parsed = strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-' || parsed < low ||
        parsed > high) {
        tba_error_set("%s=%s is invalid: expected a whole number of bytes in [%zu, %zu]; "
                      "using %zu",
                      name, text, low, high, *value);
        return;
    }
    *value = (size_t)parsed;
}

static void read_register_mode(int *value) {
    const char *text = getenv("TBA_HOOK_REGISTER");
    if (text == NULL || text[0] == '\0') {
        return;
    }
    if (strcasecmp(text, "all") == 0) {
        *value = TBA_REGISTER_ALL;
    } else if (strcasecmp(text, "tba") == 0) {
        *value = TBA_REGISTER_TBA;
    } else {
        tba_error_set("TBA_HOOK_REGISTER=%s is invalid: expected all (every allocation) or tba "
                      "(only tba's reload buffers); using all",
                      text);
    }
}

void tba_settings_read(struct tba_hook_settings *out) {
    out->enabled = 1;
    out->register_mode = TBA_REGISTER_ALL;
    out->min_bytes = TBA_HOOK_DEFAULT_MIN_BYTES;
    out->max_segments = TBA_HOOK_DEFAULT_MAX_SEGMENTS;
    out->cufile_library[0] = '\0';

    read_flag("TBA_HOOK_ENABLED", &out->enabled);
    read_register_mode(&out->register_mode);
    read_size("TBA_HOOK_MIN_BYTES", 0, SIZE_MAX, &out->min_bytes);
    read_size("TBA_HOOK_MAX_SEGMENTS", 1, TBA_HOOK_LIMIT_MAX_SEGMENTS, &out->max_segments);

    const char *library = getenv("TBA_HOOK_CUFILE_LIBRARY");
    if (library != NULL && library[0] != '\0') {
        if (strlen(library) >= sizeof out->cufile_library) {
            tba_error_set("TBA_HOOK_CUFILE_LIBRARY is longer than %zu characters; ignoring it",
                          sizeof out->cufile_library - 1);
        } else {
            strcpy(out->cufile_library, library);
        }
    }
}
