#include "registry.h"

#include <stdlib.h>

/* Fibonacci hashing: device pointers are 512-byte aligned (segments far more), so the low bits
 * carry no information; the multiply spreads the high ones. */
static size_t slot_of(const struct tba_registry *registry, uintptr_t key) {
    uint64_t mixed = (uint64_t)(key >> 9) * UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(mixed >> 32) & registry->mask;
}

int tba_registry_init(struct tba_registry *registry, size_t capacity) {
    pthread_mutex_init(&registry->lock, NULL);
    atomic_init(&registry->count, 0);
    registry->total_bytes = 0;
    size_t num_slots = 2;
    while (num_slots < 2 * capacity) {
        num_slots *= 2;
    }
    registry->slots = calloc(num_slots, sizeof *registry->slots);
    if (registry->slots == NULL) {
        registry->mask = 0;
        registry->capacity = 0;
        return -1;
    }
    registry->mask = num_slots - 1;
    registry->capacity = capacity;
    return 0;
}

/* Index of key's slot, or of the empty slot where the probe for key ends. */
static size_t probe(const struct tba_registry *registry, uintptr_t key) {
    size_t i = slot_of(registry, key);
    while (registry->slots[i].key != 0 && registry->slots[i].key != key) {
        i = (i + 1) & registry->mask;
    }
    return i;
}

enum tba_registry_insert_result tba_registry_insert(struct tba_registry *registry, uintptr_t key,
                                                    size_t size, size_t *old_size) {
    enum tba_registry_insert_result result = TBA_REGISTRY_FULL;
    pthread_mutex_lock(&registry->lock);
    if (registry->slots != NULL) {
        size_t i = probe(registry, key);
        if (registry->slots[i].key == key) {
            *old_size = registry->slots[i].size;
            registry->total_bytes -= registry->slots[i].size;
            registry->slots[i].size = size;
            registry->total_bytes += size;
            result = TBA_REGISTRY_REPLACED;
        } else if (atomic_load(&registry->count) < registry->capacity) {
            registry->slots[i].key = key;
            registry->slots[i].size = size;
            registry->total_bytes += size;
            atomic_fetch_add(&registry->count, 1);
            result = TBA_REGISTRY_INSERTED;
        }
    }
    pthread_mutex_unlock(&registry->lock);
    return result;
}

int tba_registry_remove(struct tba_registry *registry, uintptr_t key, size_t *size) {
    int found = 0;
    pthread_mutex_lock(&registry->lock);
    if (registry->slots != NULL) {
        size_t hole = probe(registry, key);
        if (registry->slots[hole].key == key) {
            found = 1;
            *size = registry->slots[hole].size;
            registry->total_bytes -= *size;
            atomic_fetch_sub(&registry->count, 1);
            /* Backward-shift deletion: move later members of the probe run into the hole so
             * every remaining key stays reachable from its home slot without tombstones. */
            size_t i = hole;
            for (;;) {
                i = (i + 1) & registry->mask;
                if (registry->slots[i].key == 0) {
                    break;
                }
                size_t home = slot_of(registry, registry->slots[i].key);
                /* Move slot i into the hole unless its home lies cyclically in (hole, i]. */
                int home_after_hole = hole <= i ? (hole < home && home <= i)
                                                : (hole < home || home <= i);
                if (!home_after_hole) {
                    registry->slots[hole] = registry->slots[i];
                    hole = i;
                }
            }
            registry->slots[hole].key = 0;
            registry->slots[hole].size = 0;
        }
    }
    pthread_mutex_unlock(&registry->lock);
    return found;
}

void tba_registry_totals(struct tba_registry *registry, size_t *count, size_t *total_bytes) {
    pthread_mutex_lock(&registry->lock);
    *count = atomic_load(&registry->count);
    *total_bytes = registry->total_bytes;
    pthread_mutex_unlock(&registry->lock);
}
