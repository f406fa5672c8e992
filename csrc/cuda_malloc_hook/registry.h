/* Registry of the allocations registered with cuFile: pointer -> size.
 *
 * A fixed-capacity open-addressing table (linear probing, deletion by backward shift) behind
 * one mutex. Its slots are allocated once, at init, so the hot path never calls malloc; a full
 * table makes inserts fail instead of growing. Callers never call into cuFile or CUDA while
 * holding the lock (see Note [Registration order] in hook.c). */
#ifndef TBA_HOOK_REGISTRY_H
#define TBA_HOOK_REGISTRY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

struct tba_registry_slot {
    uintptr_t key; /* 0 = empty; cudaMalloc never returns NULL on success */
    size_t size;
};

struct tba_registry {
    pthread_mutex_t lock;
    struct tba_registry_slot *slots;
    size_t mask;                  /* number of slots - 1 (a power of two) */
    size_t capacity;              /* entries accepted: at most half of the slots */
    size_t total_bytes;           /* sum of the sizes of the entries */
    atomic_size_t count;          /* entries; read without the lock by the free fast path */
};

enum tba_registry_insert_result {
    TBA_REGISTRY_INSERTED = 0,
    TBA_REGISTRY_REPLACED = 1, /* key was present (its free bypassed the hook): size updated */
    TBA_REGISTRY_FULL = 2,
};

/* Allocates the slots for `capacity` entries. Returns 0, or -1 when out of memory (the
 * registry then has capacity 0 and every insert reports FULL). */
int tba_registry_init(struct tba_registry *registry, size_t capacity);

/* Inserts key -> size. On REPLACED, *old_size receives the size that was stored. */
enum tba_registry_insert_result tba_registry_insert(struct tba_registry *registry, uintptr_t key,
                                                    size_t size, size_t *old_size);

/* Removes key. Returns 1 and its size in *size when it was present, else 0. */
int tba_registry_remove(struct tba_registry *registry, uintptr_t key, size_t *size);

/* Entry count and their total bytes, read together under the lock. */
void tba_registry_totals(struct tba_registry *registry, size_t *count, size_t *total_bytes);

#endif
