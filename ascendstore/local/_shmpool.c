/*
 * _shmpool: the C core of AscendStore's embedded `local` backend.
 *
 * One POSIX shared-memory segment per pool, mapped by every process of the node:
 *
 *   header | page "next" links | entry table | hash buckets | process slots | arena
 *
 * The arena is cut into fixed-size pages; an object is a chain of pages, so
 * there is no fragmentation and capacity is exact. A robust, process-shared
 * mutex guards the metadata (never the data copies):
 *
 *   put:  lock -> reserve entry + pages (evicting LRU, maybe spilling to disk)
 *         -> unlock -> copy in (+checksum) -> lock -> publish (replace) -> unlock
 *   get:  lock -> find, record version + page list -> unlock -> copy out
 *         -> lock -> check the version is unchanged -> unlock
 *
 * Readers take no pins: every change that frees an object's pages gives the
 * entry a new version, so a reader whose pages were recycled under it sees
 * the version change and retries (or reports a miss). Nothing a dead reader
 * leaves behind can pin memory. A writer's reservation names its process
 * slot; reservations of dead processes are reclaimed by a sweep. A slot is
 * alive while its process holds an OFD lock on the slot's byte of the lock
 * file next to the segment (/dev/shm/ascendstore-lock.<name>; a name no pool segment can have): the kernel
 * drops the lock when the process dies, whatever PID namespace it runs in, so
 * containers sharing /dev/shm judge each other correctly (pids would not).
 * A process that dies holding the lock makes the next locker get EOWNERDEAD; it then
 * rebuilds every derived structure (free lists, hash chains, LRU) from the
 * entry table, which is the single source of truth.
 *
 * Optional disk tier: objects evicted from DRAM are appended to bounded
 * segment files (oldest segment dropped when full) and promoted back to DRAM
 * on a hit. Spills happen under the pool lock (simple; see docs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <stddef.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ constants */

#define POOL_MAGIC 0x31305453414c5341ULL /* "ASLAST01" */
#define POOL_LAYOUT 10u
#define NONE32 0xffffffffu
#define MAX_KEY 256
#define MAX_PROCS 512
#define MAX_SEGS 256
#define MAX_PATH_LEN 512

enum { ST_OK = 0, ST_NOT_FOUND, ST_NO_SPACE, ST_TIMEOUT, ST_UNAVAILABLE, ST_CORRUPT, ST_INVALID };
/* SPILLING: a LIVE object being written to disk by its owner outside the lock
 * (still readable, in the hash, not in the LRU). SPILL_DEAD: it was removed
 * meanwhile; the owner frees its pages when the write is done. */
enum { E_FREE = 0, E_RESERVED = 1, E_LIVE = 2, E_DISK = 3, E_SPILLING = 4, E_SPILL_DEAD = 5 };
#define ST_PENDING 100

/* ------------------------------------------------------------------ shared layout */

typedef struct {
    uint64_t version;   /* unique per (object, residency); 0 when free */
    uint64_t hash;
    uint64_t size;
    uint64_t tick;      /* last access, to rebuild LRU order after a crash */
    uint64_t checksum;
    uint64_t disk_off;
    uint32_t disk_seg;
    uint32_t hnext;     /* hash chain, or free-entry list */
    uint32_t prev, next; /* DRAM LRU list (LIVE) */
    uint32_t first_page;
    uint32_t npages;
    uint32_t state;
    int32_t owner;      /* process slot of a RESERVED entry */
    uint32_t keylen;
    uint32_t has_sum;
    uint64_t pin_until; /* CLOCK_MONOTONIC ns: not evicted before (while its pinner lives) */
    int32_t pin_slot;   /* the pinning process's slot, PIN_SHARED when several pinned it */
    /* 1: these bytes sit at (disk_seg, disk_off) and the entry is in the disk list.
     * Always for DISK; for LIVE, the copy a promotion left behind (the object came
     * from there unchanged), so evicting it again writes nothing. */
    uint32_t on_disk;
    uint32_t dprev, dnext; /* disk list, by disk position */
    char key[MAX_KEY];
} entry_t;

#define PIN_SHARED (-2)

/* A slot is alive while in_use and its byte of the lock file is locked (see
 * slot_alive); pid is informational only (it means nothing across PID namespaces). */
typedef struct {
    int32_t pid;
    int32_t in_use;
    uint64_t flags; /* SLOT_*; zeroed when a process takes the slot (builds before it wrote 0 here) */
} slot_t;

/* The slot's process makes the pool's 2 MiB pages as it fills (collapse_step): one live
 * process at a time. Taken, given up and taken over under the pool lock; the bits from
 * SLOT_BEAT_SHIFT up hold when the holder last stepped (CLOCK_MONOTONIC ms, as pins: one
 * clock for every process of the host), which it refreshes without the lock (a CAS that
 * fails once the role was taken from it). */
#define SLOT_FILLS 1ull
#define SLOT_BEAT_SHIFT 16
#define SLOT_FLAG_BITS ((1ull << SLOT_BEAT_SHIFT) - 1)

typedef struct {
    uint64_t magic;
    uint32_t layout;
    _Atomic uint32_t ready;
    uint64_t total_size;
    uint64_t capacity;
    uint64_t page_size;
    uint32_t n_pages, max_keys, n_buckets, checksum;
    uint64_t off_next, off_entries, off_buckets, off_slots, off_events, off_arena;
    uint64_t ev_cap; /* removal records kept (power of two) */
    uint64_t disk_capacity, disk_seg_size;
    char disk_path[MAX_PATH_LEN];
    char name[128];
    _Atomic uint32_t destroyed;
    _Atomic int32_t debug_holder;
    pthread_mutex_t lock;
    /* everything below is guarded by lock */
    uint32_t free_page_head, free_pages;
    uint32_t free_entry_head, entries_used;
    uint32_t lru_head, lru_tail;   /* MRU .. LRU of LIVE entries */
    uint32_t disk_head, disk_tail; /* newest .. oldest disk copies (DISK entries, clean LIVE ones) */
    uint32_t n_live, n_disk, reserved_pages;
    uint32_t entries_hwm; /* entries at or above this index were never used (untouched memory) */
    uint64_t next_version, tick;
    uint64_t live_bytes;
    uint64_t disk_first_seg, disk_cur_seg, disk_cur_off, disk_file_bytes, disk_live_bytes;
    uint64_t seg_len[MAX_SEGS];
    uint64_t ev_next; /* sequence number of the next removal record */
    /* Pinned objects that left the pool other than by a newer value of their key
     * (removed, or lost in a rebuild after a crash). Pins stop eviction: a run a
     * lookup pinned while this read N is whole for as long as it still reads N
     * (within the lease). Written under the lock, read without it (pin_breaks). */
    uint64_t pin_breaks;
    /* counters */
    uint64_t c_hits, c_misses, c_puts, c_evictions, c_spills, c_disk_hits, c_promotions, c_disk_drops,
        c_corrupt, c_no_space, c_lock_recoveries, c_dead_reclaimed, c_retries, c_pinned_skips, c_pins,
        c_clean_spills;
} hdr_t;

/* Removal records: a bounded ring in the segment, written under the pool
 * lock (one record per object leaving a tier), read by any process with
 * removed_since(). A record is complete before ev_next moves past it, so a
 * process killed while writing one leaves nothing half-written behind. */
enum { TIER_CPU = 0, TIER_DISK = 1, TIER_NONE = 255 };
enum { R_NONE = 0, R_EVICTED, R_REMOVED, R_SPILLED, R_PROMOTED, R_LOST };

typedef struct {
    uint64_t seq;
    uint8_t tier, reason, moved_to, pad;
    uint32_t keylen;
    char key[MAX_KEY];
} event_t;

/* ------------------------------------------------------------------ process-local handle */

typedef struct {
    uint32_t idx;
    uint32_t spill; /* 0: a put's reservation; 1: a spill victim */
    uint64_t token;
} orphan_t;

typedef struct Pool {
    PyObject_HEAD
    PyObject *weakreflist;
    hdr_t *h;
    uint8_t *base;
    size_t map_size;
    char shm_name[160];
    char lock_name[170]; /* shm name of the slot lock file */
    char huge_dir[128];  /* a hugetlbfs mount holding the segment, or "" for a /dev/shm object */
    uint64_t huge_page;  /* that mount's page size (0: /dev/shm) */
    int collapsed;       /* MADV_COLLAPSE made 2 MiB pages of the arena through this handle */
    int created;         /* this process created the pool's segment */
    uint64_t fill_cursor; /* collapse_step: arena bytes below this were looked at by this handle */
    int filling;          /* this handle holds the pool's filler role (SLOT_FILLS on its slot) */
    int lock_fd;         /* this handle's own open of it (its own OFD: its own locks) */
    struct Pool *all_next, *all_prev; /* every open handle, to drop inherited lock fds after fork */
    int slot;
    pid_t pid;
    int unlink_on_last_close;
    _Atomic double delay_s;       /* test hook: every data call of this handle acts slow */
    _Atomic double spill_stall_s; /* test hook: pause between spill writes and finalizing them */
    _Atomic double put_stall_s;   /* test hook: pause every put between reserving and copying in */
    _Atomic double scan_stall_s;  /* test hook: pause a linear prefix scan between its blocks (unlocked) */
    _Atomic int busy;
    _Atomic int closed;
    pthread_mutex_t local; /* guards the fields below (threads of this process) */
    int seg_fd[MAX_SEGS];
    uint64_t seg_id[MAX_SEGS];
    orphan_t *orphans;
    int n_orphans, cap_orphans;
} Pool;

static PyObject *status_table = NULL; /* tuple of Status members, indexed by code */

#define NEXT(p) ((uint32_t *)((p)->base + (p)->h->off_next))
#define ENT(p) ((entry_t *)((p)->base + (p)->h->off_entries))
#define BUCKETS(p) ((uint32_t *)((p)->base + (p)->h->off_buckets))
#define SLOTS(p) ((slot_t *)((p)->base + (p)->h->off_slots))
#define ARENA(p) ((p)->base + (p)->h->off_arena)
#define EVENTS(p) ((event_t *)((p)->base + (p)->h->off_events))

/* ------------------------------------------------------------------ hashing */

/* Key hash, streaming so a scan can continue it from each key prefix's state.
 * One multiply per 8-byte word, where FNV-1a (layouts < 9) took one per byte: a
 * 128k-token prompt's lookup hashes ~1024 keys of ~120 bytes, and that chain of
 * dependent multiplies was most of the scan's native time, and the part a busy
 * host slowed most (the scan ran 55% slower in the VM's slow phases, an exists
 * 26%). Words are read little-endian, so a key hashes the same however it is
 * split into updates; the length and a final avalanche (murmur3's fmix64) go in
 * last, since only the low bits pick the bucket. */
typedef struct {
    uint64_t h, tail, len;
    uint32_t ntail; /* bytes held in tail, < 8 */
} kh_t;

#define KH_SEED 0x9e3779b97f4a7c15ULL
#define KH_MUL 0xff51afd7ed558ccdULL

static inline uint64_t kh_word(uint64_t h, uint64_t w) {
    uint64_t x = (h ^ w) * KH_MUL;
    return (x << 29) | (x >> 35); /* the rotation brings the product's high bits down */
}

static inline uint64_t kh_load(const char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static inline void kh_init(kh_t *s) { *s = (kh_t){KH_SEED, 0, 0, 0}; }

static inline void kh_update(kh_t *s, const char *p, size_t n) {
    s->len += n;
    uint64_t h = s->h, tail = s->tail;
    uint32_t t = s->ntail;
    if (t == 0) {
        for (; n >= 8; p += 8, n -= 8) h = kh_word(h, kh_load(p));
    } else {
        /* t bytes of a word are open (a key prefix rarely ends on a word): each
         * 8 bytes read complete it and leave t bytes open again, no byte loop */
        unsigned sh = 8 * t;
        for (; n >= 8; p += 8, n -= 8) {
            uint64_t w = kh_load(p);
            h = kh_word(h, tail | (w << sh));
            tail = w >> (64 - sh);
        }
    }
    for (; n; n--) {
        tail |= (uint64_t)(uint8_t)*p++ << (8 * t);
        if (++t == 8) {
            h = kh_word(h, tail);
            tail = 0;
            t = 0;
        }
    }
    s->h = h;
    s->tail = tail;
    s->ntail = t;
}

static inline uint64_t kh_final(const kh_t *s) {
    uint64_t h = s->ntail ? kh_word(s->h, s->tail) : s->h;
    h ^= s->len * 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* the hash of prefix state s continued by n more bytes (s is not changed) */
static inline uint64_t kh_more(kh_t s, const char *p, size_t n) {
    kh_update(&s, p, n);
    return kh_final(&s);
}

static uint64_t key_hash(const char *k, size_t n) {
    kh_t s;
    kh_init(&s);
    return kh_more(s, k, n);
}

/* Streaming object checksum (independent of how the bytes are split into
 * calls). 64-byte stripes feed 8 64-bit lanes: lane += lo32(d^k) * hi32(d^k)
 * + neighbour word, with a per-stripe key; every 16 stripes the lanes are
 * scrambled so stripe order matters. Same math in AVX2 and scalar form. */
#define CK_LANES 8
#define CK_BLOCK 16
#define CKP1 0x9E3779B185EBCA87ULL
#define CKP2 0xC2B2AE3D27D4EB4FULL
#define CKP3 0x165667B19E3779F9ULL
#define CK_SCR_MUL 0x9E3779B1ULL
typedef struct {
    uint64_t acc[CK_LANES];
    uint8_t buf[64];
    size_t blen;
    uint64_t total;
    uint32_t stripe; /* stripes since the last scramble */
} ck_t;

static uint64_t ck_keys[CK_BLOCK][CK_LANES] __attribute__((aligned(32)));
static uint64_t ck_scr[CK_LANES] __attribute__((aligned(32)));
static int ck_have_avx2 = 0;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void ck_setup(void) {
    uint64_t s = 0x4153434e44535452ULL;
    for (int b = 0; b < CK_BLOCK; b++)
        for (int i = 0; i < CK_LANES; i++) ck_keys[b][i] = splitmix(&s);
    for (int i = 0; i < CK_LANES; i++) ck_scr[i] = splitmix(&s);
    __builtin_cpu_init();
    ck_have_avx2 = __builtin_cpu_supports("avx2");
}

static void ck_init(ck_t *c) {
    for (int i = 0; i < CK_LANES; i++) c->acc[i] = ck_scr[i] ^ (CKP1 * (i + 1));
    c->blen = 0;
    c->total = 0;
    c->stripe = 0;
}

static inline void ck_scramble_scalar(uint64_t *acc) {
    for (int i = 0; i < CK_LANES; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= ck_scr[i];
        acc[i] = a * CK_SCR_MUL;
    }
}

static void ck_stripes_scalar(ck_t *c, const uint8_t *p, size_t n) {
    for (size_t s = 0; s < n; s++, p += 64) {
        uint64_t d[CK_LANES];
        memcpy(d, p, 64);
        const uint64_t *k = ck_keys[c->stripe];
        for (int i = 0; i < CK_LANES; i++) {
            uint64_t x = d[i] ^ k[i];
            c->acc[i] += (x & 0xffffffffULL) * (x >> 32) + d[i ^ 1];
        }
        if (++c->stripe == CK_BLOCK) {
            ck_scramble_scalar(c->acc);
            c->stripe = 0;
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define CK_AVX2_STEP(P, DST, KI)                                                                      \
    do {                                                                                          \
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(P));                                    \
        __m256i d1 = _mm256_loadu_si256((const __m256i *)((P) + 32));                             \
        if (DST) {                                                                                \
            _mm256_storeu_si256((__m256i *)(DST), d0);                                            \
            _mm256_storeu_si256((__m256i *)((DST) + 32), d1);                                     \
        }                                                                                         \
        __m256i x0 = _mm256_xor_si256(d0, _mm256_load_si256((const __m256i *)&ck_keys[KI][0]));   \
        __m256i x1 = _mm256_xor_si256(d1, _mm256_load_si256((const __m256i *)&ck_keys[KI][4]));   \
        __m256i m0 = _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32));                             \
        __m256i m1 = _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32));                             \
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(m0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2)))); \
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(m1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2)))); \
    } while (0)

#define CK_AVX2_SCRAMBLE()                                                                         \
    do {                                                                                          \
        a0 = _mm256_xor_si256(_mm256_xor_si256(a0, _mm256_srli_epi64(a0, 47)), scr0);             \
        a1 = _mm256_xor_si256(_mm256_xor_si256(a1, _mm256_srli_epi64(a1, 47)), scr1);             \
        /* 64-bit multiply by a 32-bit constant: lo*m + (hi*m << 32) */                          \
        a0 = _mm256_add_epi64(_mm256_mul_epu32(a0, mul),                                          \
                              _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a0, 32), mul), 32)); \
        a1 = _mm256_add_epi64(_mm256_mul_epu32(a1, mul),                                          \
                              _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a1, 32), mul), 32)); \
    } while (0)

/* n stripes from p (copied to dst when dst is not NULL) into the checksum.
 * Whole 16-stripe blocks run unrolled with constant key offsets. */
__attribute__((target("avx2"))) static void ck_avx2(ck_t *c, uint8_t *dst, const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)&c->acc[0]);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)&c->acc[4]);
    const __m256i scr0 = _mm256_load_si256((const __m256i *)&ck_scr[0]);
    const __m256i scr1 = _mm256_load_si256((const __m256i *)&ck_scr[4]);
    const __m256i mul = _mm256_set1_epi64x((long long)CK_SCR_MUL);
    uint32_t stripe = c->stripe;
    while (n && stripe) { /* finish a partial block */
        CK_AVX2_STEP(p, dst, stripe);
        p += 64;
        if (dst) dst += 64;
        n--;
        if (++stripe == CK_BLOCK) {
            stripe = 0;
            CK_AVX2_SCRAMBLE();
        }
    }
    if (dst) {
        for (; n >= CK_BLOCK; n -= CK_BLOCK, p += 64 * CK_BLOCK, dst += 64 * CK_BLOCK) {
            for (int k = 0; k < CK_BLOCK; k++) CK_AVX2_STEP(p + 64 * k, dst + 64 * k, k);
            CK_AVX2_SCRAMBLE();
        }
    } else {
        for (; n >= CK_BLOCK; n -= CK_BLOCK, p += 64 * CK_BLOCK) {
            for (int k = 0; k < CK_BLOCK; k++) CK_AVX2_STEP(p + 64 * k, (uint8_t *)NULL, k);
            CK_AVX2_SCRAMBLE();
        }
    }
    for (; n; n--, p += 64) { /* a partial block at the end */
        CK_AVX2_STEP(p, dst, stripe);
        if (dst) dst += 64;
        stripe++;
    }
    _mm256_storeu_si256((__m256i *)&c->acc[0], a0);
    _mm256_storeu_si256((__m256i *)&c->acc[4], a1);
    c->stripe = stripe;
}

static void ck_stripes_avx2(ck_t *c, const uint8_t *p, size_t n) { ck_avx2(c, NULL, p, n); }

/* Copy n 64-byte stripes from src to dst and checksum them in the same pass:
 * the hash work hides under the memory traffic of the copy. */
static void ck_copy_avx2(ck_t *c, uint8_t *dst, const uint8_t *p, size_t n) { ck_avx2(c, dst, p, n); }
#endif

static inline void ck_stripes(ck_t *c, const uint8_t *p, size_t n) {
#if defined(__x86_64__)
    if (ck_have_avx2) return ck_stripes_avx2(c, p, n);
#endif
    ck_stripes_scalar(c, p, n);
}

static void ck_update(ck_t *c, const uint8_t *p, size_t n) {
    c->total += n;
    if (c->blen) {
        size_t take = 64 - c->blen < n ? 64 - c->blen : n;
        memcpy(c->buf + c->blen, p, take);
        c->blen += take;
        p += take;
        n -= take;
        if (c->blen < 64) return;
        ck_stripes(c, c->buf, 1);
        c->blen = 0;
    }
    if (n >= 64) {
        ck_stripes(c, p, n / 64);
        p += n / 64 * 64;
        n %= 64;
    }
    if (n) {
        memcpy(c->buf, p, n);
        c->blen = n;
    }
}

/* Large copies bypass the cache: a batch copied with non-temporal (streaming)
 * stores, piece by piece where a piece is at least NT_MIN_PIECE. The bytes
 * written are not read again soon by this core (a put's pool pages; a get's
 * KV, read later by attention or a DMA), so caching them only evicts the
 * caller's working set, and a store that misses the cache then costs no
 * read-for-ownership of the line (measured here on 2 MiB objects: 15-25% more
 * copy bandwidth than glibc memcpy, which streams only above ~3/4 of the L3).
 * A put streams from nt_put_min bytes (pool pages are not in cache); a get
 * only from half the last-level cache, at most NT_GET_MAX (nt_get_min),
 * because its destination may be a hot buffer that memcpy would update in
 * cache. Stores are ordered (sfence) before the batch is published. */
#define NT_MIN_PIECE 4096u
/* sysfs gives one CCX's L3 on AMD (32 MiB: half is 16 MiB), but the whole
 * socket's on Intel (480 MiB on a Xeon 6 VM), of which one core's share is a
 * few MiB: there a 64 MiB batch of 2 MiB gets did not stream and read 0.92 of
 * memcpy, against 1.32-1.35 streaming. So half the LLC, capped here. */
#define NT_GET_MAX (16u << 20)
static uint64_t nt_put_min = 1u << 20;
static uint64_t nt_get_min = NT_GET_MAX;

/* The last-level cache one core shares (sysfs: one CCX/die's L3; glibc's
 * sysconf may report the whole package's, several times larger). */
static uint64_t llc_bytes(void) {
    uint64_t out = 0;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f) {
        unsigned long long v = 0;
        char unit = 0;
        if (fscanf(f, "%llu%c", &v, &unit) >= 1)
            out = (uint64_t)v * (unit == 'K' ? 1024u : unit == 'M' ? 1048576u : 1u);
        fclose(f);
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (!out) {
        long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
        if (llc > 0) out = (uint64_t)llc;
    }
#endif
    return out;
}

static void nt_setup(void) {
    uint64_t llc = llc_bytes();
    if (!llc) return;
    uint64_t half = llc / 2 < NT_GET_MAX ? llc / 2 : NT_GET_MAX;
    nt_get_min = half > nt_put_min ? half : nt_put_min;
}

#if defined(__x86_64__)
/* dst aligned to 32 bytes first, then 128 bytes a step (unaligned loads; stores that
 * stream past the cache with nt, else aligned regular ones), the tail by memcpy. nt is
 * a constant in each caller below, so each gets a loop of its own kind. */
__attribute__((target("avx2"), always_inline)) static inline void copy_avx2(uint8_t *dst, const uint8_t *src,
                                                                          size_t n, const int nt) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head) {
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
    }
    for (; n >= 128; n -= 128, src += 128, dst += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        if (nt) {
            _mm256_stream_si256((__m256i *)dst, a);
            _mm256_stream_si256((__m256i *)(dst + 32), b);
            _mm256_stream_si256((__m256i *)(dst + 64), c);
            _mm256_stream_si256((__m256i *)(dst + 96), d);
        } else {
            _mm256_store_si256((__m256i *)dst, a);
            _mm256_store_si256((__m256i *)(dst + 32), b);
            _mm256_store_si256((__m256i *)(dst + 64), c);
            _mm256_store_si256((__m256i *)(dst + 96), d);
        }
    }
    if (n) memcpy(dst, src, n);
}

__attribute__((target("avx2"))) static void nt_copy_avx2(uint8_t *dst, const uint8_t *src, size_t n) {
    copy_avx2(dst, src, n, 1);
}

__attribute__((target("avx2"))) static void vec_copy_avx2(uint8_t *dst, const uint8_t *src, size_t n) {
    copy_avx2(dst, src, n, 0);
}
#endif

/* Source and destination that are not aligned alike within a cache line: glibc's
 * memcpy moves 2 KiB-1 MiB with `rep movsb`, which on AMD Zen 4 (EPYC 9004, glibc
 * 2.36) ran 2.5-6x slower than when they are: 64 KiB objects from a /dev/shm page
 * into a buffer at 16 mod 64 (numpy's, malloc's) 8.1 GB/s, at 1 or 8 mod 64 3.4,
 * against 20-21 aligned alike, while a vector loop read 19-21 at every offset. So
 * copies from MISALIGNED_MIN bytes whose addresses differ mod 64 take vec_copy_avx2
 * (above: stores aligned to 32 bytes, loads unaligned). vLLM's KV tensors and the pool's
 * pages are 64-byte aligned, so its own copies usually keep memcpy. */
#define MISALIGNED_MIN 2048u

/* memcpy(dst, src, n), streaming when nt (see nt_put_min) and n is large enough,
 * by a vector loop when dst and src are not aligned alike (MISALIGNED_MIN). */
static inline void copy_nt(uint8_t *dst, const uint8_t *src, size_t n, int nt) {
#if defined(__x86_64__)
    if (nt && n >= NT_MIN_PIECE && ck_have_avx2) {
        nt_copy_avx2(dst, src, n);
        return;
    }
    if (n >= MISALIGNED_MIN && (((uintptr_t)dst - (uintptr_t)src) & 63) && ck_have_avx2) {
        vec_copy_avx2(dst, src, n);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
}

/* Whether a batch of `bytes` is copied with streaming stores (a put's rule; a get also needs nt_get_min). */
static inline int nt_batch(uint64_t bytes) {
#if defined(__x86_64__)
    return ck_have_avx2 && bytes >= nt_put_min;
#else
    (void)bytes;
    return 0;
#endif
}

/* Orders a batch's streaming stores before anything that publishes it. */
static inline void nt_fence(int nt) {
#if defined(__x86_64__)
    if (nt) _mm_sfence();
#else
    (void)nt;
#endif
}

/* memcpy(dst, src, n) that also feeds the n bytes to the checksum c (if any). */
static void copy_ck(ck_t *c, uint8_t *dst, const uint8_t *src, size_t n) {
    if (!c) {
        memcpy(dst, src, n);
        return;
    }
    if (c->blen) {
        size_t t = 64 - c->blen < n ? 64 - c->blen : n;
        memcpy(dst, src, t);
        ck_update(c, src, t);
        dst += t;
        src += t;
        n -= t;
    }
    size_t ns = n / 64;
    if (ns) {
#if defined(__x86_64__)
        if (ck_have_avx2) ck_copy_avx2(c, dst, src, ns);
        else
#endif
        {
            memcpy(dst, src, ns * 64);
            ck_stripes(c, src, ns);
        }
        c->total += ns * 64;
        dst += ns * 64;
        src += ns * 64;
        n -= ns * 64;
    }
    if (n) {
        memcpy(dst, src, n);
        ck_update(c, src, n);
    }
}

static uint64_t ck_final(ck_t *c) {
    if (c->blen) { /* zero-padded last stripe; the length below tells padding from data */
        memset(c->buf + c->blen, 0, 64 - c->blen);
        ck_stripes(c, c->buf, 1);
        c->blen = 0;
    }
    uint64_t h = c->total * CKP1;
    for (int i = 0; i < CK_LANES; i++) {
        h ^= rotl64(c->acc[i] * CKP2, 31) * CKP1;
        h = rotl64(h, 27) * CKP1 + CKP3;
    }
    h ^= h >> 33;
    h *= CKP2;
    h ^= h >> 29;
    h *= CKP3;
    h ^= h >> 32;
    return h;
}

/* ------------------------------------------------------------------ time, process liveness */

static double now_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Process liveness by lock, not by pid. Each attached handle holds an OFD
 * write lock on byte <slot> of the pool's lock file for as long as it is
 * attached; the kernel releases it when the last descriptor of that open file
 * goes away (close, exit, SIGKILL). OFD locks belong to the open file, not to a
 * pid, so they are judged the same from every PID namespace that sees the
 * file, and two handles in one process (each its own open) do not merge. */
static int slot_lock_op(int fd, int slot, int cmd, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = slot;
    fl.l_len = 1;
    int r = fcntl(fd, cmd, &fl);
    if (r != 0) return -1;
    if (cmd == F_OFD_GETLK) return fl.l_type != F_UNLCK; /* 1: someone else holds it */
    return 0;
}

static int slot_lock_take(Pool *p, int slot) { return slot_lock_op(p->lock_fd, slot, F_OFD_SETLK, F_WRLCK); }

static void slot_lock_release(Pool *p, int slot) {
    if (p->lock_fd >= 0) slot_lock_op(p->lock_fd, slot, F_OFD_SETLK, F_UNLCK);
}

/* The creator of a segment holds an OFD write lock on its byte 0 from before it sizes the
 * file until the pool is ready. Unlike a pid, the lock goes away with the process however
 * it ends and reads the same from every PID namespace. F_UNLCK releases; otherwise 0 when
 * taken, -1 when another open file holds it. */
static int init_lock_op(int fd, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -1;
}

static int open_lock_file(Pool *p) {
    if (p->lock_fd >= 0) return 0;
    p->lock_fd = shm_open(p->lock_name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    return p->lock_fd >= 0 ? 0 : -1;
}

static int slot_alive(Pool *p, int s) {
    const slot_t *S = SLOTS(p);
    if (!S[s].in_use) return 0;
    if (s == p->slot && p->pid == getpid()) return 1; /* our own lock never conflicts with us */
    if (p->lock_fd < 0) return 1;                    /* cannot tell: never reclaim on a guess */
    int r = slot_lock_op(p->lock_fd, s, F_OFD_GETLK, F_WRLCK);
    return r != 0; /* held (1) or unknown (-1): alive */
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A lookup's pin holds until its lease ends or its process dies (a pin shared
 * by several processes holds until its lease ends). Lock held. */
static int entry_pinned(Pool *p, const entry_t *e, uint64_t now) {
    if (!e->pin_until || e->pin_until <= now) return 0;
    if (e->pin_slot == PIN_SHARED) return 1;
    if (e->pin_slot < 0 || e->pin_slot >= MAX_PROCS) return 0;
    return slot_alive(p, e->pin_slot);
}

/* ------------------------------------------------------------------ metadata helpers (lock held) */

static void lru_unlink(Pool *p, uint32_t i, uint32_t *head, uint32_t *tail) {
    entry_t *E = ENT(p);
    entry_t *e = &E[i];
    if (e->prev != NONE32) E[e->prev].next = e->next; else *head = e->next;
    if (e->next != NONE32) E[e->next].prev = e->prev; else *tail = e->prev;
    e->prev = e->next = NONE32;
}

static void lru_push_head(Pool *p, uint32_t i, uint32_t *head, uint32_t *tail) {
    entry_t *E = ENT(p);
    E[i].prev = NONE32;
    E[i].next = *head;
    if (*head != NONE32) E[*head].prev = i; else *tail = i;
    *head = i;
}

static void lru_push_tail(Pool *p, uint32_t i, uint32_t *head, uint32_t *tail) {
    entry_t *E = ENT(p);
    E[i].next = NONE32;
    E[i].prev = *tail;
    if (*tail != NONE32) E[*tail].next = i; else *head = i;
    *tail = i;
}

/* The disk list: every disk copy (DISK entries and the clean copies of LIVE
 * ones), newest position at the head, linked through dprev/dnext. */
static void disk_unlink(Pool *p, uint32_t i) {
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    entry_t *e = &E[i];
    if (e->dprev != NONE32) E[e->dprev].dnext = e->dnext; else h->disk_head = e->dnext;
    if (e->dnext != NONE32) E[e->dnext].dprev = e->dprev; else h->disk_tail = e->dprev;
    e->dprev = e->dnext = NONE32;
    e->on_disk = 0;
}

static void disk_push_head(Pool *p, uint32_t i) {
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    E[i].dprev = NONE32;
    E[i].dnext = h->disk_head;
    if (h->disk_head != NONE32) E[h->disk_head].dprev = i; else h->disk_tail = i;
    h->disk_head = i;
    E[i].on_disk = 1;
}

/* Is a DRAM object's clean copy worth going back to on eviction? Only while it
 * has more than half of the disk log's cycle left: segments are dropped oldest
 * first, once disk_capacity bytes are written after them, so a copy written
 * more than half of that ago is dropped soon, and an object read back from
 * there (warm) is written afresh instead, as any spill, to live a whole cycle
 * again. Distance in whole segments (the current one counts 0). Lock held. */
static int disk_copy_kept(const hdr_t *h, const entry_t *e) {
    return e->on_disk && 2 * (h->disk_cur_seg - e->disk_seg) * h->disk_seg_size < h->disk_capacity;
}

/* Entry `to` takes entry `from`'s disk copy and its place in the disk list (a
 * promotion: the key's new DRAM entry keeps the copy it was read from). */
static void disk_take_over(Pool *p, uint32_t from, uint32_t to) {
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    entry_t *f = &E[from], *t = &E[to];
    t->disk_seg = f->disk_seg;
    t->disk_off = f->disk_off;
    t->dprev = f->dprev;
    t->dnext = f->dnext;
    if (f->dprev != NONE32) E[f->dprev].dnext = to; else h->disk_head = to;
    if (f->dnext != NONE32) E[f->dnext].dprev = to; else h->disk_tail = to;
    t->on_disk = 1;
    f->dprev = f->dnext = NONE32;
    f->on_disk = 0;
}

static void touch(Pool *p, uint32_t i) {
    hdr_t *h = p->h;
    entry_t *e = &ENT(p)[i];
    e->tick = ++h->tick;
    if (e->state == E_LIVE && h->lru_head != i) {
        lru_unlink(p, i, &h->lru_head, &h->lru_tail);
        lru_push_head(p, i, &h->lru_head, &h->lru_tail);
    }
}

/* The entry of the key pre + suf (compared in place: a scan builds no key copy), or NONE32. */
static inline uint32_t find2(Pool *p, const char *pre, uint32_t pl, const char *suf, uint32_t sl, uint64_t hash) {
    entry_t *E = ENT(p);
    uint32_t i = BUCKETS(p)[hash & (p->h->n_buckets - 1)];
    while (i != NONE32) {
        entry_t *e = &E[i];
        if (e->hash == hash && e->keylen == pl + sl && memcmp(e->key + pl, suf, sl) == 0 &&
            memcmp(e->key, pre, pl) == 0)
            return i;
        i = e->hnext;
    }
    return NONE32;
}

static uint32_t find(Pool *p, const char *key, uint32_t klen, uint64_t hash) {
    return find2(p, key, klen, key + klen, 0, hash);
}

/* A loop of probes runs ahead of itself: before probing key k it asks for the
 * bucket of key k + PROBE_FAR and for the first entry of the chain of key k +
 * PROBE_NEAR, whose bucket was asked for PROBE_FAR - PROBE_NEAR keys before. In a
 * pool larger than the caches a probe is two misses to memory, the second waiting
 * on the first, and a loop of probes paid them one after the other; this way the
 * misses of ~16 keys overlap (docs/benchmarking.md: a 128k prompt's lookup among
 * 200k objects, cold caches, 0.69-0.84 ms -> 0.44-0.47). Hints
 * only: no answer depends on them, and a prefetch cannot fault. Lock held.
 * (always_inline: gcc takes a function that only prefetches for one without
 * effects, and drops its calls before it would inline it.) */
#define PROBE_NEAR 8
#define PROBE_FAR 16

__attribute__((always_inline)) static inline void prefetch_bucket(Pool *p, uint64_t hash) {
    __builtin_prefetch(&BUCKETS(p)[hash & (p->h->n_buckets - 1)]);
}

__attribute__((always_inline)) static inline void prefetch_chain(Pool *p, uint64_t hash) {
    uint32_t i = BUCKETS(p)[hash & (p->h->n_buckets - 1)];
    if (i != NONE32) {
        const char *e = (const char *)&ENT(p)[i];
        __builtin_prefetch(e);      /* its hash and chain link */
        __builtin_prefetch(e + 64); /* its key's length and the key's head */
    }
}

/* Before probing key k of n (hashes hv(k)): the first keys' lines at k == 0, then
 * those of the keys PROBE_NEAR and PROBE_FAR ahead. A macro: the hashes sit in an
 * array or in a field of each item. */
#define PROBE_AHEAD(p, k, n, hv)                                                                   \
    do {                                                                                           \
        if ((k) == 0) {                                                                            \
            for (size_t k_ = 0; k_ < (size_t)(n) && k_ < PROBE_FAR; k_++) prefetch_bucket(p, hv(k_)); \
            for (size_t k_ = 0; k_ < (size_t)(n) && k_ < PROBE_NEAR; k_++) prefetch_chain(p, hv(k_)); \
        }                                                                                          \
        if ((size_t)(k) + PROBE_FAR < (size_t)(n)) prefetch_bucket(p, hv((size_t)(k) + PROBE_FAR));  \
        if ((size_t)(k) + PROBE_NEAR < (size_t)(n)) prefetch_chain(p, hv((size_t)(k) + PROBE_NEAR)); \
    } while (0)

static void hash_insert(Pool *p, uint32_t i) {
    entry_t *e = &ENT(p)[i];
    uint32_t *b = &BUCKETS(p)[e->hash & (p->h->n_buckets - 1)];
    e->hnext = *b;
    *b = i;
}

static void hash_unlink(Pool *p, uint32_t i) {
    entry_t *E = ENT(p);
    uint32_t *link = &BUCKETS(p)[E[i].hash & (p->h->n_buckets - 1)];
    while (*link != NONE32) {
        if (*link == i) {
            *link = E[i].hnext;
            E[i].hnext = NONE32;
            return;
        }
        link = &E[*link].hnext;
    }
}

/* Return a chain of pages to the free list, keeping their order so the next
 * allocation gets the same contiguous run back. */
static void pages_free(Pool *p, uint32_t first, uint32_t n) {
    if (!n || first == NONE32) return;
    uint32_t *nx = NEXT(p);
    uint32_t last = first;
    for (uint32_t k = 1; k < n; k++) last = nx[last];
    nx[last] = p->h->free_page_head;
    p->h->free_page_head = first;
    p->h->free_pages += n;
}

static uint32_t pages_alloc(Pool *p, uint32_t n) {
    if (!n) return NONE32;
    uint32_t *nx = NEXT(p);
    uint32_t first = p->h->free_page_head, last = first;
    for (uint32_t k = 1; k < n; k++) last = nx[last];
    p->h->free_page_head = nx[last];
    nx[last] = NONE32;
    p->h->free_pages -= n;
    return first;
}

static void entry_release(Pool *p, uint32_t i) {
    entry_t *e = &ENT(p)[i];
    memset(e, 0, offsetof(entry_t, key));
    e->state = E_FREE;
    e->prev = e->next = e->dprev = e->dnext = e->first_page = NONE32;
    e->hnext = p->h->free_entry_head;
    p->h->free_entry_head = i;
    p->h->entries_used--;
}

static int entry_tier(const entry_t *e) { return e->state == E_DISK ? TIER_DISK : TIER_CPU; }

/* Append a removal record for entry i (lock held). */
static void event_record(Pool *p, uint32_t i, int tier, int reason, int moved_to) {
    hdr_t *h = p->h;
    if (!h->ev_cap || reason == R_NONE) return;
    entry_t *e = &ENT(p)[i];
    event_t *ev = &EVENTS(p)[h->ev_next & (h->ev_cap - 1)];
    uint32_t kl = e->keylen <= MAX_KEY ? e->keylen : MAX_KEY;
    ev->seq = h->ev_next;
    ev->tier = (uint8_t)tier;
    ev->reason = (uint8_t)reason;
    ev->moved_to = (uint8_t)moved_to;
    ev->keylen = kl;
    memcpy(ev->key, e->key, kl);
    atomic_thread_fence(memory_order_release); /* the record is whole before it counts */
    h->ev_next++;
}

/* Remove a published entry (LIVE, DISK or SPILLING) completely, recording why
 * (R_NONE: the key stays in the same tier, e.g. replaced by a newer value). */
static void entry_remove(Pool *p, uint32_t i, int reason) {
    hdr_t *h = p->h;
    entry_t *e = &ENT(p)[i];
    if (reason != R_NONE && e->pin_until && entry_pinned(p, e, now_ns()))
        __atomic_add_fetch(&h->pin_breaks, 1, __ATOMIC_RELEASE);
    event_record(p, i, entry_tier(e), reason, TIER_NONE);
    hash_unlink(p, i);
    if (e->on_disk) disk_unlink(p, i); /* a LIVE entry's clean copy goes with it */
    if (e->state == E_SPILLING) { /* its spiller frees the pages once its write is done */
        h->n_live--;
        h->live_bytes -= e->size;
        e->state = E_SPILL_DEAD;
        return;
    }
    if (e->state == E_LIVE) {
        lru_unlink(p, i, &h->lru_head, &h->lru_tail);
        pages_free(p, e->first_page, e->npages);
        h->n_live--;
        h->live_bytes -= e->size;
    } else if (e->state == E_DISK) {
        h->n_disk--;
        h->disk_live_bytes -= e->size;
    }
    entry_release(p, i);
}

static void reservation_drop(Pool *p, uint32_t i) {
    entry_t *e = &ENT(p)[i];
    pages_free(p, e->first_page, e->npages);
    p->h->reserved_pages -= e->npages;
    entry_release(p, i);
}

/* ------------------------------------------------------------------ disk tier (lock held unless noted) */

static void seg_path(Pool *p, uint64_t seg, char *out, size_t n) {
    snprintf(out, n, "%s/%s.%08llu.seg", p->h->disk_path, p->h->name, (unsigned long long)seg);
}

/* Process-local fd cache; caller holds p->local. Closes fds of dropped segments. */
static int seg_fd_locked(Pool *p, uint64_t seg, int create) {
    uint64_t first = p->h->disk_first_seg;
    for (int k = 0; k < MAX_SEGS; k++)
        if (p->seg_fd[k] >= 0 && p->seg_id[k] < first) {
            close(p->seg_fd[k]);
            p->seg_fd[k] = -1;
        }
    int k = (int)(seg % MAX_SEGS);
    if (p->seg_fd[k] >= 0 && p->seg_id[k] == seg) return p->seg_fd[k];
    if (p->seg_fd[k] >= 0) close(p->seg_fd[k]);
    p->seg_fd[k] = -1;
    char path[MAX_PATH_LEN + 200];
    seg_path(p, seg, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
    if (fd < 0) return -1;
    p->seg_fd[k] = fd;
    p->seg_id[k] = seg;
    return fd;
}

static void disk_drop_oldest_segment(Pool *p) {
    hdr_t *h = p->h;
    uint64_t seg = h->disk_first_seg;
    entry_t *E = ENT(p);
    while (h->disk_tail != NONE32 && E[h->disk_tail].disk_seg <= (uint32_t)seg) {
        uint32_t t = h->disk_tail;
        if (E[t].state == E_DISK) {
            entry_remove(p, t, R_EVICTED);
            h->c_disk_drops++;
        } else {
            disk_unlink(p, t); /* a DRAM object's clean copy: it stays in DRAM, its next eviction writes */
        }
    }
    char path[MAX_PATH_LEN + 200];
    seg_path(p, seg, path, sizeof path);
    unlink(path);
    h->disk_file_bytes -= h->seg_len[seg % MAX_SEGS];
    h->seg_len[seg % MAX_SEGS] = 0;
    if (seg == h->disk_cur_seg) {
        h->disk_cur_seg++;
        h->disk_cur_off = 0;
    }
    h->disk_first_seg++;
}

static int seg_pinned(Pool *p, uint64_t seg);

/* Reserve size bytes at the end of the disk log, dropping the oldest segments
 * to stay within disk_capacity. Lock held. -1 if the object is too big. */
static int disk_reserve(Pool *p, uint64_t size, uint64_t *seg, uint64_t *off) {
    hdr_t *h = p->h;
    if (size > h->disk_capacity / 2) return -1; /* a segment may exceed seg_size by one object */
    if (h->disk_cur_off > 0 && h->disk_cur_off + size > h->disk_seg_size) {
        h->disk_cur_seg++;
        h->disk_cur_off = 0;
        h->seg_len[h->disk_cur_seg % MAX_SEGS] = 0;
    }
    /* a segment holding a pinned object is not dropped: the spill fails instead
     * (and the caller evicts an unpinned DRAM object without spilling it) */
    while (h->disk_file_bytes + size > h->disk_capacity && h->disk_first_seg <= h->disk_cur_seg) {
        if (seg_pinned(p, h->disk_first_seg)) return -1;
        disk_drop_oldest_segment(p);
    }
    while (h->disk_cur_seg - h->disk_first_seg >= MAX_SEGS - 1) {
        if (seg_pinned(p, h->disk_first_seg)) return -1;
        disk_drop_oldest_segment(p);
    }
    *seg = h->disk_cur_seg;
    *off = h->disk_cur_off;
    h->disk_cur_off += size;
    h->seg_len[*seg % MAX_SEGS] += size;
    h->disk_file_bytes += size;
    return 0;
}

/* Write an object's page chain at (seg, off). Needs no pool lock as long as
 * the caller owns the pages. 0 on success. */
static int disk_write_pages(Pool *p, uint32_t first_page, uint64_t size, uint64_t seg, uint64_t off) {
    pthread_mutex_lock(&p->local);
    int fd = seg_fd_locked(p, seg, 1);
    if (fd >= 0) fd = dup(fd);
    pthread_mutex_unlock(&p->local);
    if (fd < 0) return -1;
    int rc = 0;
    uint32_t *nx = NEXT(p);
    uint64_t P = p->h->page_size, left = size, pos = off;
    struct iovec iov[64];
    int niov = 0;
    uint32_t pg = first_page;
    /* contiguous page runs become one iovec; one syscall per 64 runs */
    while (left && rc == 0) {
        uint64_t len = left < P ? left : P;
        uint8_t *src = ARENA(p) + (uint64_t)pg * P;
        if (niov && (uint8_t *)iov[niov - 1].iov_base + iov[niov - 1].iov_len == src)
            iov[niov - 1].iov_len += len;
        else {
            if (niov == 64) {
                size_t tot = 0;
                for (int k = 0; k < niov; k++) tot += iov[k].iov_len;
                if (pwritev(fd, iov, niov, (off_t)pos) != (ssize_t)tot) rc = -1;
                pos += tot;
                niov = 0;
            }
            iov[niov].iov_base = src;
            iov[niov].iov_len = len;
            niov++;
        }
        left -= len;
        pg = nx[pg];
    }
    if (rc == 0 && niov) {
        size_t tot = 0;
        for (int k = 0; k < niov; k++) tot += iov[k].iov_len;
        if (pwritev(fd, iov, niov, (off_t)pos) != (ssize_t)tot) rc = -1;
    }
    close(fd);
    return rc;
}

/* Write a LIVE entry to the disk tier while holding the lock (the fallback
 * when spilling outside the lock did not free enough pages). 0 on success. */
static int disk_spill(Pool *p, uint32_t i) {
    entry_t *e = &ENT(p)[i];
    uint64_t seg, off;
    if (disk_reserve(p, e->size, &seg, &off) != 0) return -1;
    if (disk_write_pages(p, e->first_page, e->size, seg, off) != 0) return -1;
    e->disk_seg = (uint32_t)seg;
    e->disk_off = off;
    return 0;
}

/* Insert a DISK entry into the disk list, which stays ordered by disk position
 * (newest at the head), so that dropping the oldest segment finds all of its
 * objects at the tail. Spills of several processes can finish out of order
 * (one writes into segment s while another already wrote s+1), so insert by
 * position, not at the head: the walk passes only the spills that overtook
 * this one. Lock held. */
static void disk_list_insert(Pool *p, uint32_t i) {
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    const entry_t *e = &E[i];
    uint32_t after = NONE32, at = h->disk_head; /* insert between after and at */
    while (at != NONE32 && (E[at].disk_seg > e->disk_seg || (E[at].disk_seg == e->disk_seg && E[at].disk_off > e->disk_off))) {
        after = at;
        at = E[at].dnext;
    }
    if (after == NONE32) {
        disk_push_head(p, i);
        return;
    }
    E[i].dprev = after;
    E[i].dnext = at;
    E[after].dnext = i;
    if (at != NONE32) E[at].dprev = i;
    else h->disk_tail = i;
    E[i].on_disk = 1;
}

/* A LIVE entry whose bytes are now on disk: free its pages, move it to the disk
 * list (a clean entry is there already: its copy is where it was read from). */
static void entry_to_disk(Pool *p, uint32_t i) {
    hdr_t *h = p->h;
    entry_t *e = &ENT(p)[i];
    event_record(p, i, TIER_CPU, R_SPILLED, TIER_DISK); /* left DRAM, now stored on disk */
    pages_free(p, e->first_page, e->npages);
    h->n_live--;
    h->live_bytes -= e->size;
    e->first_page = NONE32;
    e->npages = 0;
    e->state = E_DISK;
    e->owner = -1;
    e->version = ++h->next_version; /* readers of the old pages must look again */
    if (!e->on_disk) disk_list_insert(p, i);
    else h->c_clean_spills++;
    h->n_disk++;
    h->disk_live_bytes += e->size;
    h->c_spills++;
}

/* The least recently used entry of a list (from its tail) that no live
 * lookup has pinned; NONE32 if there is none. Lock held. */
static uint32_t lru_victim(Pool *p, uint32_t tail) {
    entry_t *E = ENT(p);
    uint64_t now = 0;
    for (uint32_t i = tail; i != NONE32; i = E[i].prev) {
        if (!E[i].pin_until) return i;
        if (!now) now = now_ns();
        if (!entry_pinned(p, &E[i], now)) return i;
        p->h->c_pinned_skips++;
    }
    return NONE32;
}

/* The oldest object that lives only on disk and is not pinned (the disk list
 * also holds the clean copies of DRAM objects, which are skipped); NONE32 if
 * there is none. Lock held. */
static uint32_t disk_victim(Pool *p) {
    entry_t *E = ENT(p);
    uint64_t now = 0;
    for (uint32_t i = p->h->disk_tail; i != NONE32; i = E[i].dprev) {
        if (E[i].state != E_DISK) continue;
        if (!E[i].pin_until) return i;
        if (!now) now = now_ns();
        if (!entry_pinned(p, &E[i], now)) return i;
        p->h->c_pinned_skips++;
    }
    return NONE32;
}

/* Does the oldest disk segment hold a pinned object? (Its objects sit at the
 * tail of the disk list.) Lock held. */
/* The versions of the disk objects this thread is promoting right now (op_get's
 * promotion, a conditional put): the spills that make room for them must not
 * drop the segment they were read from, or the promotion would find its own
 * object gone and the object just read would leave the pool. */
static __thread const uint64_t *promoting;
static __thread Py_ssize_t n_promoting;

static int seg_pinned(Pool *p, uint64_t seg) {
    entry_t *E = ENT(p);
    uint64_t now = now_ns();
    for (uint32_t i = p->h->disk_tail; i != NONE32 && E[i].disk_seg <= (uint32_t)seg; i = E[i].dprev) {
        if (E[i].state != E_DISK) continue; /* a DRAM object needs no copy */
        for (Py_ssize_t k = 0; k < n_promoting; k++)
            if (promoting[k] == E[i].version) return 1;
        if (E[i].pin_until && entry_pinned(p, &E[i], now)) {
            p->h->c_pinned_skips++;
            return 1;
        }
    }
    return 0;
}

/* Evict the least recently used DRAM object (spilling it when the disk tier
 * is on). Returns 0 when there was nothing to evict. */
static int evict_one(Pool *p, int allow_spill) {
    hdr_t *h = p->h;
    uint32_t i = lru_victim(p, h->lru_tail);
    if (i == NONE32) return 0; /* empty, or every object is pinned */
    h->c_evictions++;
    /* a clean copy (left by its promotion) makes the spill free: nothing to write */
    if (allow_spill && ENT(p)[i].on_disk && !disk_copy_kept(h, &ENT(p)[i])) disk_unlink(p, i);
    if (allow_spill && h->disk_capacity && (ENT(p)[i].on_disk || disk_spill(p, i) == 0)) {
        lru_unlink(p, i, &h->lru_head, &h->lru_tail);
        entry_to_disk(p, i);
        return 1;
    }
    entry_remove(p, i, R_EVICTED);
    return 1;
}

static uint32_t entry_alloc(Pool *p) {
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    uint32_t i;
    if (h->free_entry_head != NONE32 || h->entries_hwm >= h->max_keys) {
        while (h->free_entry_head == NONE32) {
            uint32_t d = disk_victim(p);
            if (d != NONE32) {
                entry_remove(p, d, R_EVICTED);
                h->c_disk_drops++;
            } else if (!evict_one(p, 0)) {
                return NONE32;
            }
        }
        i = h->free_entry_head;
        h->free_entry_head = E[i].hnext;
    } else {
        i = h->entries_hwm++; /* never used: the memory is touched only now */
        memset(&E[i], 0, offsetof(entry_t, key));
        E[i].prev = E[i].next = E[i].dprev = E[i].dnext = E[i].first_page = NONE32;
    }
    E[i].hnext = NONE32;
    h->entries_used++;
    return i;
}

/* ------------------------------------------------------------------ sweep and rebuild */

/* Free slots of dead processes and the reservations they held. Lock held. */
static int sweep_dead(Pool *p) {
    hdr_t *h = p->h;
    slot_t *S = SLOTS(p);
    static __thread uint8_t dead[MAX_PROCS];
    int ndead = 0;
    for (int s = 0; s < MAX_PROCS; s++) {
        dead[s] = 0;
        if (S[s].in_use && !slot_alive(p, s)) {
            S[s].in_use = 0;
            dead[s] = 1;
            ndead++;
        }
    }
    if (!ndead) return 0;
    entry_t *E = ENT(p);
    for (uint32_t i = 0; i < h->entries_hwm; i++) {
        entry_t *e = &E[i];
        if (e->owner < 0 || e->owner >= MAX_PROCS || !dead[e->owner]) continue;
        if (e->state == E_RESERVED) {
            reservation_drop(p, i);
            h->c_dead_reclaimed++;
        } else if (e->state == E_SPILLING) { /* its spill never finished: it is simply LIVE again */
            e->state = E_LIVE;
            e->owner = -1;
            lru_push_tail(p, i, &h->lru_head, &h->lru_tail);
            h->c_dead_reclaimed++;
        } else if (e->state == E_SPILL_DEAD) {
            pages_free(p, e->first_page, e->npages);
            entry_release(p, i);
            h->c_dead_reclaimed++;
        }
    }
    return ndead;
}

static int cmp_tick_desc(const void *a, const void *b, void *arg) {
    const entry_t *E = arg;
    uint64_t x = E[*(const uint32_t *)a].tick, y = E[*(const uint32_t *)b].tick;
    return x < y ? 1 : x > y ? -1 : 0;
}

static int cmp_disk_desc(const void *a, const void *b, void *arg) {
    const entry_t *E = arg;
    const entry_t *x = &E[*(const uint32_t *)a], *y = &E[*(const uint32_t *)b];
    if (x->disk_seg != y->disk_seg) return x->disk_seg < y->disk_seg ? 1 : -1;
    return x->disk_off < y->disk_off ? 1 : x->disk_off > y->disk_off ? -1 : 0;
}

/* Rebuild free lists, hash chains and LRU lists from the entry table after a
 * process died holding the lock. Entries that do not validate are dropped. */
static void rebuild(Pool *p) {
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    uint32_t *nx = NEXT(p);
    uint8_t *owned = calloc(h->n_pages ? h->n_pages : 1, 1);
    uint32_t *chain = malloc(sizeof(uint32_t) * (h->n_pages + 1));
    uint32_t *order = malloc(sizeof(uint32_t) * (h->max_keys + 1));
    slot_t *S = SLOTS(p);
    for (int s = 0; s < MAX_PROCS; s++)
        if (S[s].in_use && !slot_alive(p, s)) S[s].in_use = 0;
    for (uint32_t b = 0; b < h->n_buckets; b++) BUCKETS(p)[b] = NONE32;
    h->free_page_head = NONE32;
    h->free_pages = 0;
    h->free_entry_head = NONE32;
    h->entries_used = 0;
    h->lru_head = h->lru_tail = h->disk_head = h->disk_tail = NONE32;
    h->n_live = h->n_disk = h->reserved_pages = 0;
    h->live_bytes = h->disk_live_bytes = 0;
    uint64_t P = h->page_size;
    if (h->entries_hwm > h->max_keys) h->entries_hwm = h->max_keys;
    for (uint32_t i = h->entries_hwm; i-- > 0;) {
        entry_t *e = &E[i];
        int owner_alive = e->owner >= 0 && e->owner < MAX_PROCS && S[e->owner].in_use;
        if (e->state == E_SPILLING && !owner_alive) e->state = E_LIVE; /* the spill never finished */
        int ok = (e->state >= E_RESERVED && e->state <= E_SPILL_DEAD) && e->keylen > 0 && e->keylen <= MAX_KEY;
        if (ok && (e->state == E_RESERVED || e->state == E_SPILL_DEAD)) ok = owner_alive;
        int copy_ok = e->disk_seg >= h->disk_first_seg && e->disk_seg <= h->disk_cur_seg && h->disk_capacity;
        if (ok && e->state == E_DISK) ok = copy_ok;
        /* a DRAM object's clean copy counts only where it is sure to be there */
        e->on_disk = e->state == E_DISK || (e->state == E_LIVE && e->on_disk && copy_ok);
        int hashed = e->state == E_LIVE || e->state == E_DISK || e->state == E_SPILLING;
        int dup = 0;
        if (ok && hashed && find(p, e->key, e->keylen, e->hash) != NONE32) ok = 0, dup = 1;
        if (ok && e->state != E_DISK) {
            uint64_t need = (e->size + P - 1) / P;
            ok = need == e->npages && need <= h->n_pages;
            uint32_t pg = e->first_page;
            for (uint32_t k = 0; ok && k < e->npages; k++) {
                if (pg >= h->n_pages || owned[pg]) ok = 0;
                else {
                    owned[pg] = 1;
                    chain[k] = pg;
                    pg = nx[pg];
                }
                if (!ok)
                    for (uint32_t j = 0; j < k; j++) owned[chain[j]] = 0;
            }
            if (ok && e->npages) nx[chain[e->npages - 1]] = NONE32;
        }
        if (!ok) {
            /* a published object that does not validate is gone: say so (a
             * duplicate's key is still there, under its other entry) */
            if (hashed && !dup && e->keylen > 0 && e->keylen <= MAX_KEY)
                event_record(p, i, entry_tier(e), R_LOST, TIER_NONE);
            if (hashed && !dup) __atomic_add_fetch(&h->pin_breaks, 1, __ATOMIC_RELEASE); /* pinned or not */
            memset(e, 0, offsetof(entry_t, key));
            e->state = E_FREE;
            e->prev = e->next = e->dprev = e->dnext = e->first_page = NONE32;
            e->hnext = h->free_entry_head;
            h->free_entry_head = i;
            continue;
        }
        h->entries_used++;
        e->prev = e->next = e->dprev = e->dnext = NONE32;
        if (e->state == E_LIVE || e->state == E_DISK) e->owner = -1;
        if (e->state == E_RESERVED) h->reserved_pages += e->npages;
        if (e->state == E_SPILLING) { /* live, readable, not in the LRU until its spiller is done */
            h->n_live++;
            h->live_bytes += e->size;
        }
        if (hashed) hash_insert(p, i);
        else e->hnext = NONE32;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < h->entries_hwm; i++)
        if (E[i].state == E_LIVE) order[n++] = i;
    qsort_r(order, n, sizeof(uint32_t), cmp_tick_desc, E);
    for (uint32_t k = n; k-- > 0;) {
        lru_push_head(p, order[k], &h->lru_head, &h->lru_tail);
        h->n_live++;
        h->live_bytes += E[order[k]].size;
    }
    n = 0;
    for (uint32_t i = 0; i < h->entries_hwm; i++)
        if (E[i].state != E_FREE && E[i].on_disk) order[n++] = i;
    qsort_r(order, n, sizeof(uint32_t), cmp_disk_desc, E);
    for (uint32_t k = n; k-- > 0;) {
        disk_push_head(p, order[k]);
        if (E[order[k]].state != E_DISK) continue;
        h->n_disk++;
        h->disk_live_bytes += E[order[k]].size;
    }
    for (uint32_t pg = h->n_pages; pg-- > 0;)
        if (!owned[pg]) {
            nx[pg] = h->free_page_head;
            h->free_page_head = pg;
            h->free_pages++;
        }
    free(owned);
    free(chain);
    free(order);
}

/* ------------------------------------------------------------------ locking */

static void orphans_clean(Pool *p);

/* Lock with a deadline (CLOCK_MONOTONIC seconds). Call without the GIL. */
static int pool_lock(Pool *p, double deadline) {
    hdr_t *h = p->h;
    int r = pthread_mutex_trylock(&h->lock);
    if (r == EBUSY) {
        struct timespec ts;
        double d = deadline < 0 ? 0 : deadline;
        ts.tv_sec = (time_t)d;
        ts.tv_nsec = (long)((d - (double)ts.tv_sec) * 1e9);
        r = pthread_mutex_clocklock(&h->lock, CLOCK_MONOTONIC, &ts);
    }
    if (r == EOWNERDEAD) {
        rebuild(p);
        h->c_lock_recoveries++;
        atomic_store(&h->debug_holder, 0);
        pthread_mutex_consistent(&h->lock);
        r = 0;
    }
    if (r == ETIMEDOUT) return ST_TIMEOUT;
    if (r != 0) return ST_UNAVAILABLE;
    if (atomic_load(&h->destroyed)) {
        pthread_mutex_unlock(&h->lock);
        return ST_UNAVAILABLE;
    }
    if (p->n_orphans) orphans_clean(p);
    return ST_OK;
}

static void pool_unlock(Pool *p) { pthread_mutex_unlock(&p->h->lock); }

/* Undo what this handle left behind when a lock wait timed out mid-operation. */
static void orphans_clean(Pool *p) {
    pthread_mutex_lock(&p->local);
    hdr_t *h = p->h;
    entry_t *E = ENT(p);
    for (int k = 0; k < p->n_orphans; k++) {
        uint32_t i = p->orphans[k].idx;
        entry_t *e = &E[i];
        if (e->owner != p->slot || e->version != p->orphans[k].token) continue;
        if (!p->orphans[k].spill) {
            if (e->state == E_RESERVED) reservation_drop(p, i);
        } else if (e->state == E_SPILLING) { /* never finalized: keep it in DRAM */
            e->state = E_LIVE;
            e->owner = -1;
            lru_push_tail(p, i, &h->lru_head, &h->lru_tail);
        } else if (e->state == E_SPILL_DEAD) {
            pages_free(p, e->first_page, e->npages);
            entry_release(p, i);
        }
    }
    p->n_orphans = 0;
    pthread_mutex_unlock(&p->local);
}

static void orphan_add(Pool *p, uint32_t idx, uint64_t token, int spill) {
    pthread_mutex_lock(&p->local);
    if (p->n_orphans == p->cap_orphans) {
        int cap = p->cap_orphans ? p->cap_orphans * 2 : 64;
        orphan_t *o = realloc(p->orphans, sizeof(orphan_t) * cap);
        if (!o) {
            pthread_mutex_unlock(&p->local);
            return; /* left until this process exits; the sweep reclaims it then */
        }
        p->orphans = o;
        p->cap_orphans = cap;
    }
    p->orphans[p->n_orphans].idx = idx;
    p->orphans[p->n_orphans].spill = (uint32_t)spill;
    p->orphans[p->n_orphans].token = token;
    p->n_orphans++;
    pthread_mutex_unlock(&p->local);
}

/* ------------------------------------------------------------------ slots */

static int slot_attach(Pool *p) {
    slot_t *S = SLOTS(p);
    sweep_dead(p);
    /* lock first, then mark in use (both under the pool lock): a sweeper never
     * sees an in-use slot whose lock is not yet taken */
    for (int s = 0; s < MAX_PROCS; s++)
        if (!S[s].in_use && slot_lock_take(p, s) == 0) {
            S[s].pid = getpid();
            S[s].flags = 0;
            S[s].in_use = 1;
            return s;
        }
    return -1;
}

/* ------------------------------------------------------------------ batch parsing */

typedef struct {
    uint64_t addr, len;
} reg_t;

typedef struct {
    const char *key;
    uint32_t klen;
    uint64_t hash;
    int status;
    reg_t *regs;
    uint32_t nregs;
    uint64_t total;
    /* per-operation scratch */
    uint32_t idx;
    uint64_t version;
    uint64_t size;
    uint64_t checksum;
    int has_sum;
    int state;
    uint32_t npages;
    uint32_t *pages; /* page list recorded under the lock */
    uint64_t disk_off;
    uint32_t disk_seg;
    uint64_t cond_version; /* promotion: publish only if the key still has this version */
    int present;           /* put_absent: the pool held the key already; nothing of this value stored */
} item_t;

typedef struct {
    item_t *items;
    Py_ssize_t n;
    uint64_t arg; /* per-operation argument (pin: the lease in ns; put: PUT_ABSENT or 0) */
    char *keybuf;
    reg_t *regbuf;
    uint32_t *pagebuf;
} batch_t;

static void batch_free(batch_t *b) {
    free(b->items);
    free(b->keybuf);
    free(b->regbuf);
    free(b->pagebuf);
    memset(b, 0, sizeof *b);
}

static int parse_region(PyObject *r, reg_t *out) {
    static PyObject *s_addr = NULL, *s_length = NULL;
    if (!s_addr) {
        s_addr = PyUnicode_InternFromString("addr");
        s_length = PyUnicode_InternFromString("length");
    }
    PyObject *a, *l;
    if (PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2) {
        a = PyTuple_GET_ITEM(r, 0);
        l = PyTuple_GET_ITEM(r, 1);
        Py_INCREF(a);
        Py_INCREF(l);
    } else {
        a = PyObject_GetAttr(r, s_addr);
        l = a ? PyObject_GetAttr(r, s_length) : NULL;
        if (!a || !l) {
            Py_XDECREF(a);
            PyErr_Clear();
            return -1;
        }
    }
    unsigned long long av = PyLong_AsUnsignedLongLong(a);
    unsigned long long lv = PyLong_AsUnsignedLongLong(l);
    Py_DECREF(a);
    Py_DECREF(l);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (lv && !av) return -1;
    out->addr = av;
    out->len = lv;
    return 0;
}

/* keys: sequence of str; regions: None or a sequence (one per key) of
 * sequences of Region / (addr, length). Bad entries become INVALID items. */
static int batch_parse(batch_t *b, PyObject *keys, PyObject *regions) {
    memset(b, 0, sizeof *b);
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence of str");
    if (!kf) return -1;
    PyObject *rf = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    if (regions && regions != Py_None) {
        rf = PySequence_Fast(regions, "regions must be a sequence (one entry per key)");
        if (!rf) goto fail;
        if (PySequence_Fast_GET_SIZE(rf) != n) {
            PyErr_Format(PyExc_ValueError, "%zd keys but %zd region lists", n, PySequence_Fast_GET_SIZE(rf));
            goto fail;
        }
    }
    b->n = n;
    b->items = calloc(n ? n : 1, sizeof(item_t));
    if (!b->items) goto nomem;
    size_t keytot = 0, regtot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &b->items[i];
        it->status = ST_PENDING;
        PyObject *k = PySequence_Fast_GET_ITEM(kf, i);
        Py_ssize_t kl = 0;
        const char *ks = PyUnicode_Check(k) ? PyUnicode_AsUTF8AndSize(k, &kl) : NULL;
        if (!ks) {
            PyErr_Clear();
            it->status = ST_INVALID;
        } else if (kl == 0 || kl > MAX_KEY) {
            it->status = ST_INVALID;
        } else {
            it->key = ks;
            it->klen = (uint32_t)kl;
            keytot += kl;
        }
        if (rf) {
            PyObject *rl = PySequence_Fast_GET_ITEM(rf, i);
            Py_ssize_t m = PySequence_Check(rl) && !PyUnicode_Check(rl) ? PySequence_Size(rl) : -1;
            if (m < 0) {
                PyErr_Clear();
                it->status = ST_INVALID;
            } else {
                it->nregs = (uint32_t)m;
                regtot += m;
            }
        }
    }
    b->keybuf = malloc(keytot ? keytot : 1);
    b->regbuf = malloc(sizeof(reg_t) * (regtot ? regtot : 1));
    if (!b->keybuf || !b->regbuf) goto nomem;
    size_t ko = 0, ro = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &b->items[i];
        if (it->key) {
            memcpy(b->keybuf + ko, it->key, it->klen);
            it->key = b->keybuf + ko;
            ko += it->klen;
            it->hash = key_hash(it->key, it->klen);
        }
        if (rf && it->nregs) {
            PyObject *rl = PySequence_Fast_GET_ITEM(rf, i);
            PyObject *rlf = PySequence_Fast(rl, "regions");
            if (!rlf) {
                PyErr_Clear();
                it->status = ST_INVALID;
                it->nregs = 0;
                continue;
            }
            it->regs = b->regbuf + ro;
            Py_ssize_t m = PySequence_Fast_GET_SIZE(rlf);
            if ((uint32_t)m != it->nregs) m = it->nregs < (uint32_t)m ? it->nregs : m;
            for (Py_ssize_t j = 0; j < m; j++) {
                if (parse_region(PySequence_Fast_GET_ITEM(rlf, j), &it->regs[j]) < 0) {
                    it->status = ST_INVALID;
                    break;
                }
                it->total += it->regs[j].len;
            }
            Py_DECREF(rlf);
            ro += it->nregs;
        }
    }
    Py_DECREF(kf);
    Py_XDECREF(rf);
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    Py_DECREF(kf);
    Py_XDECREF(rf);
    batch_free(b);
    return -1;
}

static PyObject *status_obj(int st) {
    if (st == ST_PENDING) st = ST_UNAVAILABLE;
    if (status_table && st >= 0 && st < PyTuple_GET_SIZE(status_table)) {
        PyObject *o = PyTuple_GET_ITEM(status_table, st);
        Py_INCREF(o);
        return o;
    }
    return PyLong_FromLong(st);
}

static PyObject *batch_result(batch_t *b) {
    PyObject *out = PyList_New(b->n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < b->n; i++) PyList_SET_ITEM(out, i, status_obj(b->items[i].status));
    return out;
}

/* (statuses, indices of the keys the pool held already): put_absent's answer. */
static PyObject *batch_result_present(batch_t *b) {
    PyObject *out = batch_result(b);
    PyObject *idx = out ? PyList_New(0) : NULL;
    for (Py_ssize_t i = 0; idx && i < b->n; i++) {
        if (!b->items[i].present) continue;
        PyObject *k = PyLong_FromSsize_t(i);
        if (!k || PyList_Append(idx, k) < 0) Py_CLEAR(idx);
        Py_XDECREF(k);
    }
    if (!idx) {
        Py_XDECREF(out);
        return NULL;
    }
    return Py_BuildValue("(NN)", out, idx);
}

/* ------------------------------------------------------------------ data movement (no lock, no GIL) */

/* Copy between a page list of the arena and scattered regions.
 * to_pool: regions -> pages; else pages -> regions. Optionally checksums the
 * object's bytes in order, in the same pass as the copy. */
static void copy_pages(Pool *p, const uint32_t *pages, uint64_t size, reg_t *regs, uint32_t nregs, int to_pool,
                       ck_t *ck, int nt) {
    uint64_t P = p->h->page_size;
    uint8_t *arena = ARENA(p);
    uint32_t r = 0;
    uint64_t roff = 0, done = 0;
    uint32_t k = 0;
    while (done < size) {
        /* a run of consecutive pages */
        uint32_t k0 = k, npages = (uint32_t)((size + P - 1) / P);
        while (k + 1 < npages && pages[k + 1] == pages[k] + 1) k++;
        k++;
        uint64_t run_end = (uint64_t)k * P < size ? (uint64_t)k * P : size;
        uint8_t *pool = arena + (uint64_t)pages[k0] * P;
        uint64_t run_len = run_end - done, pos = 0;
        while (pos < run_len) {
            while (r < nregs && roff == regs[r].len) {
                r++;
                roff = 0;
            }
            uint64_t n = regs[r].len - roff;
            if (n > run_len - pos) n = run_len - pos;
            uint8_t *mem = (uint8_t *)(uintptr_t)(regs[r].addr + roff);
            if (!ck) copy_nt(to_pool ? pool + pos : mem, to_pool ? mem : pool + pos, n, nt);
            else if (to_pool) copy_ck(ck, pool + pos, mem, n);
            else copy_ck(ck, mem, pool + pos, n);
            pos += n;
            roff += n;
        }
        done = run_end;
    }
}

static void checksum_regions(reg_t *regs, uint32_t nregs, ck_t *ck) {
    for (uint32_t r = 0; r < nregs; r++) ck_update(ck, (const uint8_t *)(uintptr_t)regs[r].addr, regs[r].len);
}

/* ------------------------------------------------------------------ core operations (no GIL) */

static int enter(Pool *p) {
    atomic_fetch_add(&p->busy, 1);
    if (atomic_load(&p->closed) || !p->h) {
        atomic_fetch_sub(&p->busy, 1);
        return -1;
    }
    return 0;
}

static void leave(Pool *p) { atomic_fetch_sub(&p->busy, 1); }

static void set_pending(batch_t *b, int st) {
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (b->items[i].status == ST_PENDING) b->items[i].status = st;
}

/* After fork the child has the mapping but not a slot of its own. */
static int ensure_slot(Pool *p, double deadline) {
    if (p->pid == getpid()) return ST_OK;
    pthread_mutex_init(&p->local, NULL);
    p->n_orphans = 0;
    p->filling = 0; /* the parent's role: its slot, not the one this child takes */
    /* the parent's lock fd (if the fork handler did not close it) shares the
     * parent's open file and so its slot locks: take a fresh open of our own */
    if (p->lock_fd >= 0) close(p->lock_fd);
    p->lock_fd = -1;
    if (open_lock_file(p) != 0) return ST_UNAVAILABLE;
    int st = pool_lock(p, deadline);
    if (st) return st;
    int s = slot_attach(p);
    pool_unlock(p);
    if (s < 0) return ST_UNAVAILABLE;
    p->slot = s;
    p->pid = getpid();
    return ST_OK;
}

static void op_exists(Pool *p, batch_t *b, double deadline) {
    int st = pool_lock(p, deadline);
    if (st) return set_pending(b, st);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
#define ITEM_HASH(k) (b->items[k].hash) /* (0 for an item that is not pending: a harmless hint) */
        PROBE_AHEAD(p, i, b->n, ITEM_HASH);
#undef ITEM_HASH
        if (it->status != ST_PENDING) continue;
        uint32_t e = find(p, it->key, it->klen, it->hash);
        if (e == NONE32) it->status = ST_NOT_FOUND;
        else {
            touch(p, e);
            it->status = ST_OK;
        }
    }
    pool_unlock(p);
}

/* Pin one entry until ``until`` (ns): this process's pin, or shared when another
 * live process pins it too (a shared pin ends with its lease only). Lock held. */
static void pin_entry(Pool *p, entry_t *e, uint64_t now, uint64_t until) {
    if (e->pin_slot == PIN_SHARED && e->pin_until > now) {
        /* stays shared: ends with its lease only */
    } else if (e->pin_slot != p->slot && entry_pinned(p, e, now)) {
        e->pin_slot = PIN_SHARED; /* another live process pins it too */
    } else {
        e->pin_slot = p->slot;
        if (e->pin_until <= now) e->pin_until = 0;
    }
    if (until > e->pin_until) e->pin_until = until;
    p->h->c_pins++;
}

/* Drop this process's pin of one entry (a shared pin ends with its lease). Lock held. */
static void unpin_entry(Pool *p, entry_t *e) {
    if (e->pin_slot == p->slot) {
        e->pin_until = 0;
        e->pin_slot = 0;
    }
}

/* exists + pin: every key found is kept from eviction until now + lease
 * (b->arg ns) or until this process dies, whichever comes first. */
static void op_pin(Pool *p, batch_t *b, double deadline) {
    int st = pool_lock(p, deadline);
    if (st) return set_pending(b, st);
    uint64_t now = now_ns(), until = now + b->arg;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        uint32_t x = find(p, it->key, it->klen, it->hash);
        if (x == NONE32) {
            it->status = ST_NOT_FOUND;
            continue;
        }
        touch(p, x);
        pin_entry(p, &ENT(p)[x], now, until);
        it->status = ST_OK;
    }
    pool_unlock(p);
}

/* Drop this process's pins of the keys (shared pins end with their lease). */
static void op_unpin(Pool *p, batch_t *b, double deadline) {
    int st = pool_lock(p, deadline);
    if (st) return set_pending(b, st);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        uint32_t x = find(p, it->key, it->klen, it->hash);
        if (x == NONE32) {
            it->status = ST_NOT_FOUND;
            continue;
        }
        unpin_entry(p, &ENT(p)[x]);
        it->status = ST_OK;
    }
    pool_unlock(p);
}

typedef struct {
    uint32_t idx, ok;
    uint64_t version, seg, off, size;
    uint32_t first_page;
} victim_t;

/* With the disk tier on, make room for a batch by spilling LRU objects with
 * the disk I/O outside the lock: lock held on entry and on a 0 return. The
 * victims stay readable (SPILLING) until their bytes are on disk. */
static int spill_ahead(Pool *p, batch_t *b, double deadline) {
    hdr_t *h = p->h;
    uint64_t P = h->page_size, need = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        uint64_t n = (it->total + P - 1) / P;
        if (it->status == ST_PENDING && n <= h->n_pages) need += n;
    }
    if (need > h->n_pages) need = h->n_pages;
    uint64_t have = h->free_pages;
    if (have >= need) return ST_OK;
    entry_t *E = ENT(p);
    victim_t *v = NULL;
    size_t nv = 0, cap = 0;
    while (have < need) {
        uint32_t i = lru_victim(p, h->lru_tail);
        if (i == NONE32) break;
        entry_t *e = &E[i];
        uint64_t seg, off;
        h->c_evictions++;
        have += e->npages;
        if (disk_copy_kept(h, e)) { /* its promotion left a clean copy: back to it, nothing written */
            lru_unlink(p, i, &h->lru_head, &h->lru_tail);
            entry_to_disk(p, i);
            continue;
        }
        if (e->on_disk) disk_unlink(p, i); /* a copy about to be dropped: write it afresh */
        if (disk_reserve(p, e->size, &seg, &off) != 0) {
            entry_remove(p, i, R_EVICTED); /* too big for the disk tier: just evict */
            continue;
        }
        if (nv == cap) {
            cap = cap ? cap * 2 : 32;
            victim_t *nvv = realloc(v, cap * sizeof *v);
            if (!nvv) { /* out of memory: spill this one under the lock */
                lru_unlink(p, i, &h->lru_head, &h->lru_tail);
                if (disk_write_pages(p, e->first_page, e->size, seg, off) == 0) {
                    e->disk_seg = (uint32_t)seg;
                    e->disk_off = off;
                    entry_to_disk(p, i);
                } else {
                    lru_push_head(p, i, &h->lru_head, &h->lru_tail);
                    entry_remove(p, i, R_EVICTED);
                }
                continue;
            }
            v = nvv;
        }
        lru_unlink(p, i, &h->lru_head, &h->lru_tail);
        e->state = E_SPILLING;
        e->owner = p->slot;
        e->disk_seg = (uint32_t)seg;
        e->disk_off = off;
        v[nv++] = (victim_t){i, 0, e->version, seg, off, e->size, e->first_page};
    }
    if (!nv) {
        free(v);
        return ST_OK;
    }
    pool_unlock(p);
    for (size_t k = 0; k < nv; k++)
        v[k].ok = disk_write_pages(p, v[k].first_page, v[k].size, v[k].seg, v[k].off) == 0;
    double stall = atomic_load(&p->spill_stall_s);
    if (stall > 0) {
        atomic_store(&h->debug_holder, -(int32_t)getpid());
        usleep((useconds_t)(stall * 1e6));
        atomic_store(&h->debug_holder, 0);
    }
    int st = pool_lock(p, deadline);
    if (st) {
        for (size_t k = 0; k < nv; k++) orphan_add(p, v[k].idx, v[k].version, 1);
        free(v);
        return st;
    }
    for (size_t k = 0; k < nv; k++) {
        entry_t *e = &E[v[k].idx];
        if (e->owner != p->slot || e->version != v[k].version) continue; /* reclaimed by a sweep */
        if (e->state == E_SPILL_DEAD) { /* removed or replaced while we wrote it */
            pages_free(p, e->first_page, e->npages);
            entry_release(p, v[k].idx);
        } else if (e->state == E_SPILLING) {
            if (v[k].ok && v[k].seg >= h->disk_first_seg) {
                entry_to_disk(p, v[k].idx);
            } else { /* the write failed or its segment was dropped meanwhile: evict it */
                if (v[k].seg < h->disk_first_seg) {
                    char path[MAX_PATH_LEN + 200];
                    seg_path(p, v[k].seg, path, sizeof path);
                    unlink(path); /* our write may have re-created the dropped file */
                }
                event_record(p, v[k].idx, TIER_CPU, R_EVICTED, TIER_NONE);
                hash_unlink(p, v[k].idx);
                h->n_live--;
                h->live_bytes -= e->size;
                pages_free(p, e->first_page, e->npages);
                entry_release(p, v[k].idx);
            }
        }
    }
    free(v);
    return ST_OK;
}

/* Give a batch's reservations its pages in ascending order, object after object
 * (lock held; the pages are this batch's own). A get of the same keys in the
 * same order (a request's chunks, saved together and loaded together) then reads
 * the arena as one forward stream. The free list is LIFO, so without this every
 * overwrite or eviction of a batch hands its pages to the next batch in reverse:
 * 64 KiB objects read in reverse or scattered page order measured ~20% slower
 * than the same bytes read forward (issue 18). Pages are moved as runs of
 * consecutive pages (disjoint intervals, so sorting runs by start sorts pages):
 * the usual shapes, one-page objects reversed or multi-page objects out of order,
 * cost a sort of the runs only. Best effort: without memory it does nothing. */
static int cmp_run(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void batch_pages_ascending(Pool *p, batch_t *b) {
    uint64_t total = 0;
    int ascending = 1;
    uint32_t prev = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        for (uint32_t k = 0; k < it->npages; k++, total++) {
            if (total && it->pages[k] <= prev) ascending = 0;
            prev = it->pages[k];
        }
    }
    if (ascending) return;
    uint32_t *flat = malloc(sizeof(uint32_t) * total), *runs = malloc(sizeof(uint32_t) * 2 * total);
    if (!flat || !runs) goto out;
    uint64_t nr = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        for (uint32_t k = 0; k < it->npages; k++) {
            uint32_t pg = it->pages[k];
            if (nr && pg == runs[2 * (nr - 1)] + runs[2 * (nr - 1) + 1]) runs[2 * (nr - 1) + 1]++;
            else runs[2 * nr] = pg, runs[2 * nr + 1] = 1, nr++;
        }
    }
    qsort(runs, nr, 2 * sizeof(uint32_t), cmp_run);
    uint64_t o = 0;
    for (uint64_t r = 0; r < nr; r++)
        for (uint32_t j = 0; j < runs[2 * r + 1]; j++) flat[o++] = runs[2 * r] + j;
    uint32_t *nx = NEXT(p);
    o = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING || !it->npages) continue;
        for (uint32_t k = 0; k < it->npages; k++) it->pages[k] = flat[o++];
        for (uint32_t k = 0; k + 1 < it->npages; k++) nx[it->pages[k]] = it->pages[k + 1];
        nx[it->pages[it->npages - 1]] = NONE32;
        ENT(p)[it->idx].first_page = it->pages[0];
    }
out:
    free(flat);
    free(runs);
}

/* put's argument: a key the pool holds keeps its value and answers OK (marked
 * ``present``), as exists then put of the rest would, in one call and one lock. */
#define PUT_ABSENT 1

/* Put (or promote, when items carry cond_version). */
static void op_put(Pool *p, batch_t *b, double deadline) {
    hdr_t *h = p->h;
    uint64_t P = h->page_size;
    int st = pool_lock(p, deadline);
    if (st) return set_pending(b, st);
    const int absent_only = b->arg == PUT_ABSENT;
    if (absent_only) {
        /* Before any room is made: a held key neither evicts nor spills anything.
         * Touched as exists touches it (a save of it is a use). */
        for (Py_ssize_t i = 0; i < b->n; i++) {
            item_t *it = &b->items[i];
#define ITEM_HASH(k) (b->items[k].hash)
            PROBE_AHEAD(p, i, b->n, ITEM_HASH);
#undef ITEM_HASH
            if (it->status != ST_PENDING) continue;
            uint32_t e = find(p, it->key, it->klen, it->hash);
            if (e != NONE32) {
                touch(p, e);
                it->status = ST_OK;
                it->present = 1;
            }
        }
    }
    if (h->disk_capacity && (st = spill_ahead(p, b, deadline)) != ST_OK) return set_pending(b, st);
    int swept = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        uint64_t need = (it->total + P - 1) / P;
        if (need > h->n_pages) {
            it->status = ST_INVALID; /* can never be stored (NO_SPACE means full for now) */
            continue;
        }
        for (;;) {
            while (h->free_pages < need && evict_one(p, 1)) {}
            if (h->free_pages >= need || swept) break;
            swept = 1;
            sweep_dead(p);
        }
        uint32_t e = h->free_pages >= need ? entry_alloc(p) : NONE32;
        /* entry_alloc may evict DRAM objects without spilling: recheck pages */
        if (e == NONE32 || h->free_pages < need) {
            if (e != NONE32) entry_release(p, e);
            it->status = ST_NO_SPACE;
            h->c_no_space++;
            continue;
        }
        entry_t *en = &ENT(p)[e];
        en->state = E_RESERVED;
        en->owner = p->slot;
        en->hash = it->hash;
        en->size = it->total;
        en->keylen = it->klen;
        memcpy(en->key, it->key, it->klen);
        en->npages = (uint32_t)need;
        en->first_page = pages_alloc(p, (uint32_t)need);
        en->version = ++h->next_version; /* reservation token */
        h->reserved_pages += (uint32_t)need;
        it->idx = e;
        it->version = en->version;
        it->npages = (uint32_t)need;
        uint32_t *nx = NEXT(p), pg = en->first_page;
        for (uint32_t k = 0; k < need; k++, pg = nx[pg]) it->pages[k] = pg;
    }
    batch_pages_ascending(p, b);
    pool_unlock(p);

    double stall = atomic_load(&p->put_stall_s);
    if (stall > 0 && !b->items[0].cond_version) { /* a writer caught between reserve and copy */
        atomic_store(&h->debug_holder, -(int32_t)getpid());
        usleep((useconds_t)(stall * 1e6));
        atomic_store(&h->debug_holder, 0);
    }
    uint64_t batch_bytes = 0;
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (b->items[i].status == ST_PENDING) batch_bytes += b->items[i].total;
    int nt = !h->checksum && nt_batch(batch_bytes);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        ck_t ck;
        ck_init(&ck);
        copy_pages(p, it->pages, it->total, it->regs, it->nregs, 1, h->checksum ? &ck : NULL, nt);
        it->checksum = h->checksum ? ck_final(&ck) : 0;
    }
    nt_fence(nt);

    st = pool_lock(p, deadline);
    if (st) {
        for (Py_ssize_t i = 0; i < b->n; i++)
            if (b->items[i].status == ST_PENDING) orphan_add(p, b->items[i].idx, b->items[i].version, 0);
        return set_pending(b, st);
    }
    entry_t *E = ENT(p);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        entry_t *en = &E[it->idx];
        if (en->state != E_RESERVED || en->version != it->version) {
            it->status = ST_UNAVAILABLE; /* reclaimed (this process was thought dead) */
            continue;
        }
        uint32_t old = find(p, it->key, it->klen, it->hash);
        if (it->cond_version && (old == NONE32 || E[old].version != it->cond_version)) {
            reservation_drop(p, it->idx); /* the key changed meanwhile: keep the newer value */
            it->status = ST_OK;
            continue;
        }
        if (absent_only && old != NONE32) {
            /* another writer stored it while we copied: the first value stays */
            reservation_drop(p, it->idx);
            touch(p, old);
            it->status = ST_OK;
            it->present = 1;
            continue;
        }
        if (old != NONE32) { /* the new value keeps a lookup's pin on the key */
            en->pin_until = E[old].pin_until;
            en->pin_slot = E[old].pin_slot;
        }
        /* a DRAM value replaced stays in DRAM (no record); a disk one moves to DRAM.
         * A promotion's bytes are the disk copy's (read from it under this
         * version), so the new entry keeps that copy: evicting it again writes nothing. */
        if (old != NONE32 && E[old].state == E_DISK) {
            event_record(p, old, TIER_DISK, R_PROMOTED, TIER_CPU);
            if (it->cond_version) disk_take_over(p, old, it->idx);
            entry_remove(p, old, R_NONE);
        } else if (old != NONE32) {
            entry_remove(p, old, R_NONE);
        }
        h->reserved_pages -= en->npages;
        en->checksum = it->checksum;
        en->has_sum = h->checksum ? 1 : 0;
        en->owner = -1;
        en->state = E_LIVE;
        en->version = ++h->next_version;
        en->tick = ++h->tick;
        hash_insert(p, it->idx);
        lru_push_head(p, it->idx, &h->lru_head, &h->lru_tail);
        h->n_live++;
        h->live_bytes += en->size;
        if (it->cond_version) h->c_promotions++;
        else h->c_puts++;
        it->status = ST_OK;
    }
    pool_unlock(p);
}

static int disk_read(Pool *p, item_t *it) {
    /* a private fd, so neither the fd cache lock nor the pool lock is held during I/O */
    pthread_mutex_lock(&p->local);
    int fd = p->h->disk_capacity ? seg_fd_locked(p, it->disk_seg, 0) : -1;
    if (fd >= 0) fd = dup(fd);
    pthread_mutex_unlock(&p->local);
    if (fd < 0) return -1;
    int rc = 0;
    uint64_t pos = it->disk_off;
    for (uint32_t r = 0; rc == 0 && r < it->nregs;) {
        struct iovec iov[64];
        int n = 0;
        size_t tot = 0;
        for (; r < it->nregs && n < 64; r++) {
            if (!it->regs[r].len) continue;
            iov[n].iov_base = (void *)(uintptr_t)it->regs[r].addr;
            iov[n].iov_len = it->regs[r].len;
            tot += iov[n].iov_len;
            n++;
        }
        if (n && preadv(fd, iov, n, (off_t)pos) != (ssize_t)tot) rc = -1;
        pos += tot;
    }
    close(fd);
    return rc;
}

static void op_get(Pool *p, batch_t *b, double deadline) {
    hdr_t *h = p->h;
    uint64_t P = h->page_size;
    int any_disk = 0;
    for (int attempt = 0; attempt < 3; attempt++) {
        int st = pool_lock(p, deadline);
        if (st) return set_pending(b, st);
        int pending = 0;
        for (Py_ssize_t i = 0; i < b->n; i++) {
            item_t *it = &b->items[i];
            if (it->status != ST_PENDING) continue;
            uint32_t e = find(p, it->key, it->klen, it->hash);
            if (e == NONE32) {
                it->status = ST_NOT_FOUND;
                h->c_misses++;
                continue;
            }
            entry_t *en = &ENT(p)[e];
            if (en->size != it->total) {
                it->status = ST_INVALID;
                continue;
            }
            it->idx = e;
            it->version = en->version;
            it->state = (int)en->state;
            it->checksum = en->checksum;
            it->has_sum = (int)en->has_sum;
            it->size = en->size;
            if (en->state == E_DISK) {
                it->disk_seg = en->disk_seg;
                it->disk_off = en->disk_off;
                it->npages = 0;
            } else {
                it->npages = en->npages;
                uint32_t *nx = NEXT(p), pg = en->first_page;
                for (uint32_t k = 0; k < en->npages; k++, pg = nx[pg]) it->pages[k] = pg;
            }
            touch(p, e);
            pending++;
        }
        pool_unlock(p);
        if (!pending) break;

        uint64_t batch_bytes = 0;
        for (Py_ssize_t i = 0; i < b->n; i++)
            if (b->items[i].status == ST_PENDING && b->items[i].state != E_DISK && !b->items[i].has_sum)
                batch_bytes += b->items[i].size;
        int nt = batch_bytes >= nt_get_min && nt_batch(batch_bytes);
        for (Py_ssize_t i = 0; i < b->n; i++) {
            item_t *it = &b->items[i];
            if (it->status != ST_PENDING) continue;
            ck_t ck;
            ck_init(&ck);
            if (it->state == E_DISK) {
                if (disk_read(p, it) != 0) {
                    it->state = -1; /* segment gone: re-check under the lock */
                    continue;
                }
                if (it->has_sum) checksum_regions(it->regs, it->nregs, &ck);
            } else {
                copy_pages(p, it->pages, it->size, it->regs, it->nregs, 0, it->has_sum ? &ck : NULL, nt);
            }
            it->cond_version = it->has_sum ? ck_final(&ck) : 0; /* scratch: computed sum */
        }
        nt_fence(nt);

        st = pool_lock(p, deadline);
        if (st) return set_pending(b, st);
        int retry = 0;
        for (Py_ssize_t i = 0; i < b->n; i++) {
            item_t *it = &b->items[i];
            if (it->status != ST_PENDING) continue;
            entry_t *en = &ENT(p)[it->idx];
            if (it->state < 0 || en->version != it->version ||
                (en->state != E_LIVE && en->state != E_DISK && en->state != E_SPILLING)) {
                retry++;
                h->c_retries++;
                continue; /* changed under us: look it up again */
            }
            if (it->has_sum && it->cond_version != it->checksum) {
                it->status = ST_CORRUPT;
                h->c_corrupt++;
                continue;
            }
            it->status = ST_OK;
            h->c_hits++;
            if (it->state == E_DISK) {
                h->c_disk_hits++;
                any_disk = 1;
            }
        }
        pool_unlock(p);
        if (!retry) break;
    }
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (b->items[i].status == ST_PENDING) b->items[i].status = ST_NOT_FOUND;
    if (!any_disk) return;

    /* Promote disk hits to DRAM: a conditional put from the caller's regions. */
    int n = 0;
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (b->items[i].status == ST_OK && b->items[i].state == E_DISK) n++;
    batch_t pb = {0};
    pb.items = calloc(n, sizeof(item_t));
    uint32_t *pages = NULL;
    size_t npg = 0;
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (b->items[i].status == ST_OK && b->items[i].state == E_DISK) npg += (b->items[i].size + P - 1) / P;
    pages = malloc(sizeof(uint32_t) * (npg + 1));
    uint64_t *versions = malloc(sizeof(uint64_t) * (n + 1));
    if (!pb.items || !pages || !versions) {
        free(pb.items);
        free(pages);
        free(versions);
        return;
    }
    size_t po = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_OK || it->state != E_DISK) continue;
        item_t *q = &pb.items[pb.n++];
        *q = *it;
        q->status = ST_PENDING;
        q->cond_version = it->version;
        q->pages = pages + po;
        po += (it->size + P - 1) / P;
        versions[pb.n - 1] = it->version;
    }
    promoting = versions;
    n_promoting = pb.n;
    op_put(p, &pb, deadline);
    promoting = NULL;
    n_promoting = 0;
    free(pb.items);
    free(pages);
    free(versions);
}

static void op_remove(Pool *p, batch_t *b, double deadline) {
    int st = pool_lock(p, deadline);
    if (st) return set_pending(b, st);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        item_t *it = &b->items[i];
        if (it->status != ST_PENDING) continue;
        uint32_t e = find(p, it->key, it->klen, it->hash);
        if (e == NONE32) it->status = ST_NOT_FOUND;
        else {
            entry_remove(p, e, R_REMOVED);
            it->status = ST_OK;
        }
    }
    pool_unlock(p);
}

/* ------------------------------------------------------------------ open / close */

static int valid_name(const char *s) {
    size_t n = strlen(s);
    if (!n || n > 100) return 0; /* keeps "ascendstore-pool.<name>" within the header's name field */
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.'))
            return 0;
    }
    return s[0] != '.';
}

typedef struct {
    uint64_t capacity, page_size, disk_capacity, disk_seg_size;
    uint32_t max_keys, checksum;
    const char *disk_path;
} geom_t;

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static void layout(geom_t *g, hdr_t *h) {
    h->capacity = g->capacity;
    h->page_size = g->page_size;
    h->n_pages = (uint32_t)(g->capacity / g->page_size);
    h->max_keys = g->max_keys;
    uint32_t nb = 1;
    while (nb < g->max_keys) nb <<= 1;
    h->n_buckets = nb;
    h->checksum = g->checksum;
    h->off_next = align_up(sizeof(hdr_t), 4096);
    h->off_entries = align_up(h->off_next + sizeof(uint32_t) * (uint64_t)h->n_pages, 4096);
    h->off_buckets = align_up(h->off_entries + sizeof(entry_t) * (uint64_t)h->max_keys, 4096);
    h->off_slots = align_up(h->off_buckets + sizeof(uint32_t) * (uint64_t)nb, 4096);
    /* removal records: about one per key slot, 1 Ki .. 64 Ki (272 bytes each; memory
     * is touched only as records are written) */
    uint64_t ev = 1024;
    while (ev < g->max_keys && ev < 65536) ev <<= 1;
    h->ev_cap = ev;
    h->off_events = align_up(h->off_slots + sizeof(slot_t) * MAX_PROCS, 4096);
    h->off_arena = align_up(h->off_events + sizeof(event_t) * ev, 2u << 20);
    h->total_size = h->off_arena + (uint64_t)h->n_pages * g->page_size;
    h->disk_capacity = g->disk_path && g->disk_path[0] ? g->disk_capacity : 0;
    h->disk_seg_size = g->disk_seg_size;
    snprintf(h->disk_path, sizeof h->disk_path, "%s", g->disk_path ? g->disk_path : "");
}

static void init_shared(Pool *p, geom_t *g, const char *name) {
    hdr_t *h = p->h;
    snprintf(h->name, sizeof h->name, "%s", name);
    h->lru_head = h->lru_tail = h->disk_head = h->disk_tail = NONE32;
    uint32_t *nx = NEXT(p);
    for (uint32_t i = 0; i < h->n_pages; i++) nx[i] = i + 1 < h->n_pages ? i + 1 : NONE32;
    h->free_page_head = h->n_pages ? 0 : NONE32;
    h->free_pages = h->n_pages;
    h->free_entry_head = NONE32; /* entries are handed out from entries_hwm first */
    h->entries_hwm = 0;
    uint32_t *B = BUCKETS(p);
    for (uint32_t i = 0; i < h->n_buckets; i++) B[i] = NONE32;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&h->lock, &a);
    pthread_mutexattr_destroy(&a);
    (void)g;
}

static void disk_files_remove(hdr_t *h) {
    if (!h->disk_capacity) return;
    for (uint64_t s = h->disk_first_seg; s <= h->disk_cur_seg; s++) {
        char path[MAX_PATH_LEN + 200];
        snprintf(path, sizeof path, "%s/%s.%08llu.seg", h->disk_path, h->name, (unsigned long long)s);
        unlink(path);
    }
}

/* A new pool starts its segment ids at 0: remove files a crashed earlier pool
 * of the same name left in disk_path, or they would count against nothing. */
static void disk_files_remove_leftovers(hdr_t *h) {
    if (!h->disk_capacity) return;
    DIR *d = opendir(h->disk_path);
    if (!d) return;
    char prefix[160];
    int pl = snprintf(prefix, sizeof prefix, "%s.", h->name);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t n = strlen(de->d_name);
        if (strncmp(de->d_name, prefix, pl) == 0 && n > 4 && strcmp(de->d_name + n - 4, ".seg") == 0)
            unlinkat(dirfd(d), de->d_name, 0);
    }
    closedir(d);
}

#define HUGE_2M ((size_t)2 << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

/* Map a /dev/shm segment at an address on a 2 MiB boundary (the file's offset 0 there),
 * so that a 2 MiB page of the file can back a 2 MiB stretch of the mapping: the kernel
 * aligns shmem mappings itself only where the mount grants huge pages, and without it
 * MADV_COLLAPSE below is refused (EINVAL). Falls back to wherever mmap puts it. */
static void *map_segment(size_t msize, int fd, int huge_page) {
    if (!huge_page) {
        uint8_t *span = mmap(NULL, msize + HUGE_2M, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (span != MAP_FAILED) {
            uint8_t *at = (uint8_t *)(((uintptr_t)span + HUGE_2M - 1) & ~(uintptr_t)(HUGE_2M - 1));
            void *h = mmap(at, msize, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
            if (h != MAP_FAILED) {
                if (at > span) munmap(span, (size_t)(at - span));
                size_t tail = (size_t)(span + msize + HUGE_2M - (at + msize));
                if (tail) munmap(at + msize, tail);
                return h;
            }
            munmap(span, msize + HUGE_2M);
        }
    }
    return mmap(NULL, msize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
}

/* Allocate the arena's memory now rather than on first touch. On /dev/shm, in 2 MiB
 * pages where the kernel can: one page touched per 2 MiB, then MADV_COLLAPSE makes each
 * such stretch one zeroed 2 MiB page (Linux 6.1+; it works on a tmpfs mounted huge=never,
 * unless shmem_enabled is "deny"). A pool in 4 KiB pages copies up to 2x slower where
 * those pages are scattered over physical memory, as on a host whose free memory is
 * fragmented (docs/local-backend.md), and needs 512x the page-table entries. Whatever
 * could not be collapsed (an older kernel, no free 2 MiB block) is then populated in
 * 4 KiB pages, as before. */
static void prefault_arena(Pool *p) {
    uint8_t *arena = ARENA(p);
    size_t len = (size_t)p->h->n_pages * p->h->page_size;
    size_t whole = ((uintptr_t)arena % HUGE_2M) ? 0 : len / HUGE_2M * HUGE_2M;
    if (!p->huge_page && whole) {
        for (size_t o = 0; o < whole; o += HUGE_2M) ((volatile uint8_t *)arena)[o] = 0;
        p->collapsed = madvise(arena, whole, MADV_COLLAPSE) == 0;
    }
    if (madvise(arena, len, MADV_POPULATE_WRITE) == 0) return;
    for (size_t o = 0; o < len; o += 4096) ((volatile uint8_t *)arena)[o] = 0;
}

/* ------------------------------------------------------------------ 2 MiB pages as the pool fills
 *
 * collapse_step(n[, stale_s]) -> (stretches made 2 MiB pages, cursor in bytes, state)
 *
 * A pool that is not prefaulted fills in 4 KiB pages as puts first touch them,
 * on a /dev/shm mounted huge=never (the usual mount): scattered over physical
 * memory where the host's free memory is fragmented, and 512x the page-table
 * entries. A thread (LocalBackend) calls this to have the kernel make each 2 MiB
 * stretch of the arena one 2 MiB page (MADV_COLLAPSE, as prefault_arena does at
 * creation) just before the pool's fill reaches it, off the puts' path.
 *
 * Every process with the pool open may run that thread; one live process at a time
 * does the work (SLOT_FILLS on its slot, taken under the lock by the first call that
 * finds no live process holding it). When that process closes the pool or dies, the
 * next call of another takes over: a pool shared by engines outlives the one that
 * created it, and its later fill still gets 2 MiB pages. The role is also taken from a
 * holder alive but not stepping for stale_s (default 10: stopped by SIGSTOP or a paused
 * container; its thread steps at least twice a second while it holds the role); once it
 * runs again, its next step finds the role gone (state 3). A process taking over walks
 * from the start (its cursor is its own); stretches already made cost it a quick call.
 *
 * The arena fills upward: pages are handed out from the free list, which starts
 * in page order and takes freed pages back at its head, so pages above the
 * highest one ever handed out are untouched. The cursor walks the stretches in
 * order, up to n of them a call; a stretch is taken when some page of it is in
 * memory (mincore: some process touched it) or it lies within the pages in use
 * plus one stretch ahead (so the next puts land in a 2 MiB page, not in 4 KiB
 * ones to be collapsed later). Stretches it made are not counted as use, so the
 * cursor never runs ahead of the pool by more than that one stretch.
 *
 * Safe beside puts and gets of any process: the kernel copies a stretch's pages
 * into the new page with them locked and unmapped, so a concurrent access waits
 * for it and sees the same bytes. Nothing is written: the page the kernel needs
 * present is faulted in with MADV_POPULATE_WRITE, which leaves data as it is.
 *
 * state: 0 caught up with the fill (call again later), 1 the whole arena was
 * looked at, -1 nothing to do here (hugetlbfs, an arena not on a 2 MiB boundary, a
 * forked child) or the kernel refuses (EINVAL: before Linux 6.1, shmem_enabled
 * deny), 2 closed, 3 another live process fills (call again later: it may be gone).
 * A stretch the kernel could not make (no free 2 MiB block:
 * EAGAIN, ENOMEM) stays in 4 KiB pages and is passed over. */
static int stretch_in_memory(uint8_t *s) {
    unsigned char vec[HUGE_2M / 4096];
    if (mincore(s, HUGE_2M, vec) != 0) return 1; /* cannot tell: as if used */
    for (size_t k = 0; k < sizeof vec; k++)
        if (vec[k] & 1) return 1;
    return 0;
}

static inline uint64_t fill_beat_ms(void) { return now_ns() / 1000000ull; }

/* A live holder that has not stepped for stale_ms is stopped (SIGSTOP, a paused
 * container) or stuck: the role is taken from it. (A beat ahead of this clock, from a
 * clock of another time namespace, counts as fresh; a holder of a build before the beat,
 * which writes none, as stale: both then make pages, which is harmless.) */
static int holder_fresh(uint64_t flags, uint64_t now_ms, uint64_t stale_ms) {
    uint64_t beat = flags >> SLOT_BEAT_SHIFT;
    return beat > now_ms || now_ms - beat <= stale_ms;
}

static PyObject *Pool_collapse_step(Pool *p, PyObject *args) {
    int n;
    double stale_s = 10.0;
    if (!PyArg_ParseTuple(args, "i|d", &n, &stale_s)) return NULL;
    if (!(stale_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "stale_s must be > 0");
        return NULL;
    }
    if (enter(p) < 0) return Py_BuildValue("(iKi)", 0, 0ULL, 2);
    int made = 0, state = 0;
    uint8_t *arena = ARENA(p);
    uint64_t P = p->h->page_size, len = (uint64_t)p->h->n_pages * P;
    uint64_t whole = ((uintptr_t)arena % HUGE_2M) ? 0 : len / HUGE_2M * HUGE_2M;
    if (p->huge_page || !whole || p->pid != getpid()) {
        leave(p);
        return Py_BuildValue("(iKi)", 0, (unsigned long long)p->fill_cursor, -1);
    }
    Py_BEGIN_ALLOW_THREADS
    uint64_t now_ms = fill_beat_ms(), stale_ms = (uint64_t)(stale_s * 1000.0);
    uint64_t *mine = &SLOTS(p)[p->slot].flags;
    if (p->filling) { /* the beat, unless another process took the role from us meanwhile */
        uint64_t f = __atomic_load_n(mine, __ATOMIC_ACQUIRE);
        uint64_t beat = (f & SLOT_FLAG_BITS) | (now_ms << SLOT_BEAT_SHIFT);
        if (!(f & SLOT_FILLS) || !__atomic_compare_exchange_n(mine, &f, beat, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            p->filling = 0;
    }
    if (!p->filling) {
        /* (a short wait: the lock is busy only for a moment, and a miss is tried again) */
        state = 3;
        if (pool_lock(p, now_mono() + 0.5) == ST_OK) {
            slot_t *S = SLOTS(p);
            int other = 0;
            for (int s = 0; s < MAX_PROCS && !other; s++) {
                uint64_t f = __atomic_load_n(&S[s].flags, __ATOMIC_ACQUIRE);
                if (s == p->slot || !(f & SLOT_FILLS) || !slot_alive(p, s)) continue;
                if (holder_fresh(f, now_ms, stale_ms)) other = 1;
                else __atomic_fetch_and(&S[s].flags, ~SLOT_FILLS, __ATOMIC_ACQ_REL); /* stopped: taken */
            }
            if (!other) {
                uint64_t f = __atomic_load_n(mine, __ATOMIC_ACQUIRE);
                __atomic_store_n(mine, (f & SLOT_FLAG_BITS) | SLOT_FILLS | (now_ms << SLOT_BEAT_SHIFT),
                                 __ATOMIC_RELEASE);
                p->filling = 1;
                state = 0;
            }
            pool_unlock(p);
        }
    }
    while (!state && made < n) {
        if (atomic_load(&p->closed)) {
            state = 2;
            break;
        }
        uint64_t at = p->fill_cursor;
        if (at >= whole) {
            state = 1;
            break;
        }
        /* pages handed out now (a racy read: a hint only, the next call reads it again) */
        uint64_t in_use = (uint64_t)(p->h->n_pages - __atomic_load_n(&p->h->free_pages, __ATOMIC_RELAXED)) * P;
        uint8_t *s = arena + at;
        if (at >= in_use + HUGE_2M && !stretch_in_memory(s)) break; /* caught up */
        if (madvise(s, 4096, MADV_POPULATE_WRITE) == 0 && madvise(s, HUGE_2M, MADV_COLLAPSE) == 0) {
            made++;
            p->collapsed = 1;
        } else if (errno == EINVAL) {
            state = -1;
            break;
        }
        p->fill_cursor = at + HUGE_2M;
    }
    Py_END_ALLOW_THREADS
    leave(p);
    return Py_BuildValue("(iKi)", made, (unsigned long long)p->fill_cursor, state);
}

/* collapse_release(): give up the filler role (the thread ends), so that another
 * process's next collapse_step takes it. Closing the pool gives it up too. */
static PyObject *Pool_collapse_release(Pool *p, PyObject *noargs) {
    (void)noargs;
    if (enter(p) < 0) Py_RETURN_NONE;
    int st = ST_OK;
    if (p->filling && p->pid == getpid()) {
        Py_BEGIN_ALLOW_THREADS
        if ((st = pool_lock(p, now_mono() + 5.0)) == ST_OK) {
            __atomic_fetch_and(&SLOTS(p)[p->slot].flags, ~SLOT_FILLS, __ATOMIC_ACQ_REL);
            p->filling = 0;
            pool_unlock(p);
        }
        Py_END_ALLOW_THREADS
    }
    leave(p);
    if (st != ST_OK) return PyErr_Format(PyExc_TimeoutError, "collapse_release: the pool lock was not free in 5 s");
    Py_RETURN_NONE;
}

/* The segment's file: a POSIX shm object (/dev/shm: 4 KiB pages unless that tmpfs is
 * mounted with huge=, see pool_open) or a file of the same name on a hugetlbfs mount. */
static void arena_path(const Pool *p, char *out, size_t n) {
    snprintf(out, n, "%s%s", p->huge_dir[0] ? p->huge_dir : "/dev/shm", p->shm_name);
}

static int arena_open(const Pool *p, int flags, mode_t mode) {
    if (!p->huge_dir[0]) return shm_open(p->shm_name, flags, mode);
    char path[320];
    arena_path(p, path, sizeof path);
    return open(path, flags, mode);
}

static int arena_unlink(const Pool *p) {
    if (!p->huge_dir[0]) return shm_unlink(p->shm_name);
    char path[320];
    arena_path(p, path, sizeof path);
    return unlink(path);
}

/* Returns -1 and sets a Python error on failure. Called with the GIL. */
/* existing: open only a pool some process made, as it was made (its options from its header):
 * a tool that inspects the pool must neither make an empty one nor be refused for options
 * it did not know. */
static int pool_open(Pool *p, const char *name, geom_t *g, double timeout_s, int prefault, int existing) {
    snprintf(p->shm_name, sizeof p->shm_name, "/ascendstore-pool.%s", name);
    /* a pool on hugetlbfs is another pool than the /dev/shm one of its name: its own lock file */
    snprintf(p->lock_name, sizeof p->lock_name, p->huge_page ? "/ascendstore-hlock.%s" : "/ascendstore-lock.%s",
             name);
    if (p->huge_page) {
        char shm_path[200];
        snprintf(shm_path, sizeof shm_path, "/dev/shm%s", p->shm_name);
        if (access(shm_path, F_OK) == 0) {
            PyErr_Format(PyExc_ValueError,
                         "pool %s already exists in /dev/shm (%s): every process of a pool must give the same "
                         "hugetlbfs", name, shm_path);
            return -1;
        }
    }
    p->lock_fd = -1;
    hdr_t want;
    memset(&want, 0, sizeof want);
    layout(g, &want);
    if (p->huge_page) /* a hugetlbfs file is sized and mapped in whole huge pages */
        want.total_size = (want.total_size + p->huge_page - 1) / p->huge_page * p->huge_page;
    char where[320];
    arena_path(p, where, sizeof where);
    double deadline = now_mono() + timeout_s;
    char err[1280] = {0}; /* room for the longest options message: two names and a disk path */
    int ok = 0, missing = 0; /* missing: existing, and there is no pool (FileNotFoundError) */
    Py_BEGIN_ALLOW_THREADS
    for (int attempt = 0; attempt < 1000 && !ok && !err[0]; attempt++) {
        int created = 0;
        int fd = arena_open(p, O_RDWR | O_CLOEXEC | (existing ? 0 : O_CREAT | O_EXCL), 0600);
        if (existing) {
            if (fd < 0) {
                if ((missing = errno == ENOENT))
                    snprintf(err, sizeof err,
                             "no such pool on this host: %s does not exist (no process has it open%s)",
                             where, p->huge_page ? "" : ", or it lives on hugetlbfs: give that option");
                else
                    snprintf(err, sizeof err, "cannot open shared memory %s: %s", where, strerror(errno));
                break;
            }
        } else if (fd >= 0) {
            created = 1;
            /* held until the pool is ready (init_lock_op), taken before the file has a
             * size, so whoever finds it sized and not ready can ask whether we are alive;
             * without it they would take us for dead and replace the segment under us */
            if (init_lock_op(fd, F_WRLCK) != 0) {
                snprintf(err, sizeof err, "cannot lock shared memory %s while creating it: %s", where,
                         strerror(errno));
                close(fd);
                arena_unlink(p);
                break;
            }
            if (ftruncate(fd, (off_t)want.total_size) != 0) {
                snprintf(err, sizeof err, "cannot size shared memory %s to %llu bytes: %s", where,
                         (unsigned long long)want.total_size, strerror(errno));
                close(fd);
                arena_unlink(p);
                break;
            }
        } else if (errno == EEXIST) {
            fd = arena_open(p, O_RDWR | O_CLOEXEC, 0600);
            if (fd < 0) {
                if (errno == ENOENT) continue; /* unlinked meanwhile */
                snprintf(err, sizeof err, "cannot open shared memory %s: %s", where, strerror(errno));
                break;
            }
        } else {
            snprintf(err, sizeof err, "cannot create shared memory %s: %s", where, strerror(errno));
            break;
        }
        /* Wait for the creator to size and initialise the segment. Creating a large
         * prefaulted pool takes seconds per GiB, so open_timeout_s bounds a wait without
         * progress, not the whole wait: while the creator holds its init lock and the
         * segment's allocated blocks grow, the deadline moves on. A creator that died
         * leaves the lock free and the segment not ready: replace it. */
        struct stat sb;
        hdr_t *h = NULL;
        size_t msize = 0;
        int map_errno = 0, dead_creator = 0, stalled = 0;
        long long blocks_seen = -1;
        double waiting_since = now_mono();
        for (;;) {
            if (fstat(fd, &sb) != 0) break;
            if (!h && (uint64_t)sb.st_size >= sizeof(hdr_t)) {
                msize = (size_t)sb.st_size;
                h = map_segment(msize, fd, p->huge_page != 0);
                if (h == MAP_FAILED) {
                    h = NULL;
                    map_errno = errno;
                    break;
                }
            }
            if (h && (created || atomic_load_explicit(&h->ready, memory_order_acquire))) break;
            if (h) {
                if (init_lock_op(fd, F_WRLCK) == 0) {
                    /* nobody initialising: ready now, or its creator is gone */
                    if (!atomic_load_explicit(&h->ready, memory_order_acquire)) {
                        dead_creator = 1;
                        /* unlinked only by whoever holds the lock and still finds this file
                         * at the path, so a second replacer cannot unlink the new segment */
                        struct stat at;
                        if (stat(where, &at) == 0 && at.st_ino == sb.st_ino && at.st_dev == sb.st_dev)
                            arena_unlink(p);
                    }
                    (void)init_lock_op(fd, F_UNLCK);
                    if (dead_creator) break;
                    continue;
                }
                if ((long long)sb.st_blocks != blocks_seen) { /* the creator is at work */
                    blocks_seen = (long long)sb.st_blocks;
                    deadline = now_mono() + timeout_s;
                }
            }
            if (now_mono() > deadline) {
                stalled = h != NULL;
                break;
            }
            usleep(now_mono() - waiting_since < 0.05 ? 1000 : 10000);
        }
        if (!created || !h) close(fd); /* a creator keeps it, and its lock, until ready */
        if (dead_creator) {
            munmap(h, msize);
            h = NULL;
            usleep(1000);
            continue;
        }
        if (!h && map_errno) {
            /* on hugetlbfs a mapping reserves its huge pages: ENOMEM when too few are free */
            snprintf(err, sizeof err, "cannot map shared memory %s (%zu bytes): %s%s", where, msize,
                     strerror(map_errno),
                     p->huge_page && map_errno == ENOMEM
                         ? "; reserve more huge pages (vm.nr_hugepages; HugePages_Free in /proc/meminfo)"
                         : "");
            if (created) arena_unlink(p);
            break;
        }
        if (stalled) {
            snprintf(err, sizeof err,
                     "shared memory %s is being initialised by another process that has shown no progress "
                     "for %.1f s (open_timeout_s); if its creator is stuck, stop it, remove the file and retry",
                     where, timeout_s);
            munmap(h, msize);
            break;
        }
        if (!h) {
            snprintf(err, sizeof err,
                     "shared memory %s exists but was never sized (its creator died?); remove it and retry",
                     where);
            break;
        }
        p->h = h;
        p->base = (uint8_t *)h;
        p->map_size = msize;
        /* Transparent huge pages for a /dev/shm pool: a tmpfs mounted huge=advise gives
         * 2 MiB pages to the mappings that ask (huge=always or within_size without asking,
         * huge=never, the usual default, to none: then this changes nothing). A mapping's
         * own flag decides, so every process asks, and before the prefault below. */
        if (!p->huge_page) (void)madvise(h, msize, MADV_HUGEPAGE);
        if (created) {
            memcpy(h, &want, sizeof want);
            h->magic = POOL_MAGIC;
            h->layout = POOL_LAYOUT;
            init_shared(p, g, p->shm_name + 1);
            disk_files_remove_leftovers(h);
            if (prefault) prefault_arena(p);
            p->created = 1;
            atomic_store_explicit(&h->ready, 1, memory_order_release);
            close(fd); /* releases the init lock */
        } else if (h->magic != POOL_MAGIC || h->layout != POOL_LAYOUT || h->total_size != msize) {
            snprintf(err, sizeof err,
                     "shared memory %s is not an AscendStore pool of this version; remove it", where);
            munmap(h, msize);
            p->h = NULL;
            break;
        }
        /* Opened before the pool lock (a recovery under it judges slots by
         * their locks). The lock file is unlinked only under the pool lock
         * with the segment marked destroyed, so once pool_lock below finds the
         * segment not destroyed, this is the file every user of it has. */
        if (open_lock_file(p) != 0) {
            snprintf(err, sizeof err, "cannot open the lock file /dev/shm%s: %s", p->lock_name, strerror(errno));
            munmap(h, msize);
            p->h = NULL;
            break;
        }
        int st = pool_lock(p, deadline);
        if (st == ST_UNAVAILABLE && atomic_load(&h->destroyed)) {
            munmap(h, msize);
            p->h = NULL;
            close(p->lock_fd);
            p->lock_fd = -1;
            usleep(1000);
            continue; /* being destroyed by its last user: create a fresh one */
        }
        if (st) {
            snprintf(err, sizeof err, "timed out waiting for the lock of pool %s", p->shm_name);
            munmap(h, msize);
            p->h = NULL;
            break;
        }
        if (!created && !existing && (h->capacity != want.capacity || h->page_size != want.page_size ||
                         h->max_keys != want.max_keys || h->checksum != want.checksum ||
                         h->disk_capacity != want.disk_capacity || strcmp(h->disk_path, want.disk_path) != 0)) {
            sweep_dead(p);
            int live = 0;
            slot_t *S = SLOTS(p);
            for (int s = 0; s < MAX_PROCS; s++) live += S[s].in_use;
            if (!live) { /* stale pool from an earlier run: replace it */
                atomic_store(&h->destroyed, 1);
                disk_files_remove(h);
                shm_unlink(p->lock_name); /* before the segment: see pool_detach */
                arena_unlink(p);
                pool_unlock(p);
                munmap(h, msize);
                p->h = NULL;
                close(p->lock_fd);
                p->lock_fd = -1;
                continue;
            }
            snprintf(err, sizeof err,
                     "pool %s is already open by %d process(es) with different options "
                     "(capacity=%llu page_size=%llu max_keys=%u checksum=%u disk_path='%s' "
                     "disk_capacity=%llu); open it with the same options or use another pool name",
                     p->shm_name, live, (unsigned long long)h->capacity, (unsigned long long)h->page_size,
                     h->max_keys, h->checksum, h->disk_path, (unsigned long long)h->disk_capacity);
            pool_unlock(p);
            munmap(h, msize);
            p->h = NULL;
            break;
        }
        int s = slot_attach(p);
        pool_unlock(p);
        if (s < 0) {
            snprintf(err, sizeof err, "pool %s has no free process slot (max %d)", p->shm_name, MAX_PROCS);
            munmap(h, msize);
            p->h = NULL;
            break;
        }
        p->slot = s;
        p->pid = getpid();
        ok = 1;
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        if (p->lock_fd >= 0) close(p->lock_fd);
        p->lock_fd = -1;
        PyErr_SetString(missing ? PyExc_FileNotFoundError : PyExc_OSError, err[0] ? err : "could not open the pool");
        return -1;
    }
    return 0;
}

/* Detach this handle; the last user (or destroy) unlinks the segment. */
static void pool_detach(Pool *p, int destroy) {
    if (!p->h) return;
    hdr_t *h = p->h;
    int unlinked = 0;
    p->filling = 0;
    if (pool_lock(p, now_mono() + 5.0) == ST_OK) {
        if (p->pid == getpid()) {
            SLOTS(p)[p->slot].in_use = 0;
            SLOTS(p)[p->slot].flags = 0; /* (the filler role goes with the slot) */
            slot_lock_release(p, p->slot);
        }
        int live = 0;
        if (!destroy) {
            sweep_dead(p); /* judged by the slot locks: processes of any PID namespace count */
            slot_t *S = SLOTS(p);
            for (int s = 0; s < MAX_PROCS; s++) live += S[s].in_use;
        }
        if (destroy || (!live && p->unlink_on_last_close)) {
            atomic_store(&h->destroyed, 1);
            disk_files_remove(h);
            /* the lock file goes first: whoever creates the next segment of
             * this name then also creates a fresh lock file */
            shm_unlink(p->lock_name);
            arena_unlink(p);
            unlinked = 1;
        }
        pool_unlock(p);
    } else if (destroy) {
        atomic_store(&h->destroyed, 1);
        shm_unlink(p->lock_name);
        arena_unlink(p);
        unlinked = 1;
    }
    if (p->lock_fd >= 0) close(p->lock_fd); /* releases our slot lock if still held */
    p->lock_fd = -1;
    (void)unlinked;
    for (int k = 0; k < MAX_SEGS; k++)
        if (p->seg_fd[k] >= 0) {
            close(p->seg_fd[k]);
            p->seg_fd[k] = -1;
        }
    munmap(p->base, p->map_size);
    p->h = NULL;
    p->base = NULL;
}

/* ------------------------------------------------------------------ Python type */

/* Every open handle of this process. After fork the child closes its copies
 * of their lock descriptors: they share the parent's open file, so a child
 * that never uses the pool would otherwise keep the parent's slots looking
 * alive after the parent died. */
static Pool *registry_head = NULL;
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

static void registry_remove(Pool *p);

static void registry_add(Pool *p) {
    registry_remove(p); /* __init__ may run twice on one object */
    pthread_mutex_lock(&registry_lock);
    p->all_prev = NULL;
    p->all_next = registry_head;
    if (registry_head) registry_head->all_prev = p;
    registry_head = p;
    pthread_mutex_unlock(&registry_lock);
}

static void registry_remove(Pool *p) {
    pthread_mutex_lock(&registry_lock);
    if (p->all_prev || registry_head == p) {
        if (p->all_prev) p->all_prev->all_next = p->all_next;
        else registry_head = p->all_next;
        if (p->all_next) p->all_next->all_prev = p->all_prev;
    }
    p->all_next = p->all_prev = NULL;
    pthread_mutex_unlock(&registry_lock);
}

static void fork_prepare(void) { pthread_mutex_lock(&registry_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&registry_lock); }
static void fork_child(void) {
    for (Pool *p = registry_head; p; p = p->all_next)
        if (p->lock_fd >= 0) {
            close(p->lock_fd);
            p->lock_fd = -1;
        }
    pthread_mutex_unlock(&registry_lock);
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Pool *p = (Pool *)PyType_GenericNew(type, args, kw);
    if (p) p->lock_fd = -1;
    return (PyObject *)p;
}

static int Pool_init(Pool *p, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "capacity", "page_size", "max_keys", "checksum", "disk_path",
                             "disk_capacity", "disk_segment_size", "open_timeout_s", "unlink_on_last_close",
                             "prefault", "hugetlbfs", "existing", NULL};
    const char *name;
    unsigned long long cap, page, dcap = 0, dseg = 64ull << 20;
    unsigned int maxk;
    int checksum = 0, unlink_last = 1, prefault = 0, existing = 0;
    const char *dpath = NULL, *huge = NULL;
    double tmo = 10.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sKKI|pzKKdppzp", kwlist, &name, &cap, &page, &maxk, &checksum,
                                     &dpath, &dcap, &dseg, &tmo, &unlink_last, &prefault, &huge,
                                     &existing))
        return -1;
    p->huge_dir[0] = 0;
    p->huge_page = 0;
    p->collapsed = 0;
    p->created = 0;
    p->fill_cursor = 0;
    p->filling = 0;
    if (huge && huge[0]) {
        struct statfs fs;
        if (strlen(huge) >= sizeof p->huge_dir) {
            PyErr_SetString(PyExc_ValueError, "hugetlbfs path too long");
            return -1;
        }
        if (statfs(huge, &fs) != 0) {
            PyErr_Format(PyExc_ValueError, "hugetlbfs %s: %s", huge, strerror(errno));
            return -1;
        }
        if ((unsigned long)fs.f_type != 0x958458f6UL) { /* HUGETLBFS_MAGIC */
            PyErr_Format(PyExc_ValueError,
                         "hugetlbfs %s is not a hugetlbfs mount (mount -t hugetlbfs none %s, as root)", huge, huge);
            return -1;
        }
        snprintf(p->huge_dir, sizeof p->huge_dir, "%s", huge);
        p->huge_page = (uint64_t)fs.f_bsize;
    }
    for (int k = 0; k < MAX_SEGS; k++) p->seg_fd[k] = -1;
    pthread_mutex_init(&p->local, NULL);
    if (!valid_name(name)) {
        PyErr_Format(PyExc_ValueError, "bad pool name '%s': use 1-100 of [A-Za-z0-9_.-], not starting with '.'", name);
        return -1;
    }
    if (page < 4096 || (page & (page - 1)) || page > (1ull << 30)) {
        PyErr_SetString(PyExc_ValueError, "page_size must be a power of two between 4 KiB and 1 GiB");
        return -1;
    }
    if (cap < page || cap / page >= NONE32) {
        PyErr_SetString(PyExc_ValueError, "capacity must hold at least one page and fewer than 2**32 pages");
        return -1;
    }
    if (maxk < 1 || maxk >= (1u << 30)) {
        PyErr_SetString(PyExc_ValueError, "max_keys must be between 1 and 2**30");
        return -1;
    }
    if (dpath && strlen(dpath) >= MAX_PATH_LEN - 1) {
        PyErr_SetString(PyExc_ValueError, "disk_path too long");
        return -1;
    }
    geom_t g = {cap / page * page, page, dcap, dseg < dcap / (MAX_SEGS / 2) ? dcap / (MAX_SEGS / 2) : dseg,
                maxk, (uint32_t)checksum, dpath};
    p->unlink_on_last_close = unlink_last;
    if (pool_open(p, name, &g, tmo, prefault && !existing, existing) != 0) return -1;
    registry_add(p);
    return 0;
}

static void Pool_dealloc(Pool *p) {
    if (p->weakreflist) PyObject_ClearWeakRefs((PyObject *)p);
    if (p->h && p->pid == getpid() && !atomic_load(&p->closed)) {
        atomic_store(&p->closed, 1);
        Py_BEGIN_ALLOW_THREADS
        while (atomic_load(&p->busy)) usleep(100);
        pool_detach(p, 0);
        Py_END_ALLOW_THREADS
    }
    registry_remove(p);
    if (p->lock_fd >= 0) close(p->lock_fd);
    p->lock_fd = -1;
    free(p->orphans);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static double arg_deadline(double timeout_s) { return now_mono() + (timeout_s > 0 ? timeout_s : 0); }

typedef void (*op_fn)(Pool *, batch_t *, double);

static PyObject *run_batch_arg(Pool *p, PyObject *keys, PyObject *regions, double timeout_s, op_fn fn,
                               int need_regs, int need_pages, uint64_t arg, PyObject *(*result)(batch_t *)) {
    batch_t b;
    if (batch_parse(&b, keys, need_regs ? regions : NULL) < 0) return NULL;
    b.arg = arg;
    if (enter(p) < 0) {
        set_pending(&b, ST_UNAVAILABLE);
    } else {
        if (need_pages) {
            uint64_t P = p->h->page_size, tot = 0;
            for (Py_ssize_t i = 0; i < b.n; i++) {
                item_t *it = &b.items[i];
                if (it->status != ST_PENDING) continue;
                uint64_t np = (it->total + P - 1) / P;
                if (np > p->h->n_pages) np = 0;
                tot += np;
            }
            b.pagebuf = malloc(sizeof(uint32_t) * (tot + 1));
            if (!b.pagebuf) {
                leave(p);
                batch_free(&b);
                return PyErr_NoMemory();
            }
            uint64_t o = 0;
            for (Py_ssize_t i = 0; i < b.n; i++) {
                item_t *it = &b.items[i];
                if (it->status != ST_PENDING) continue;
                uint64_t np = (it->total + P - 1) / P;
                if (np > p->h->n_pages) {
                    it->status = ST_INVALID; /* larger than the pool: never storable */
                    np = 0;
                }
                it->pages = b.pagebuf + o;
                o += np;
            }
        }
        double deadline = arg_deadline(timeout_s);
        Py_BEGIN_ALLOW_THREADS
        int st = ST_OK;
        double slow = atomic_load(&p->delay_s);
        if (slow > 0) { /* simulated slow store: never waits past the deadline */
            double left = deadline - now_mono();
            if (left < 0) left = 0;
            usleep((useconds_t)((slow < left ? slow : left) * 1e6));
            if (slow >= left) st = ST_TIMEOUT;
        }
        if (st) set_pending(&b, st);
        else st = ensure_slot(p, deadline);
        if (st) set_pending(&b, st);
        else fn(p, &b, deadline);
        Py_END_ALLOW_THREADS
        leave(p);
    }
    PyObject *out = result(&b);
    batch_free(&b);
    return out;
}

static PyObject *run_batch(Pool *p, PyObject *keys, PyObject *regions, double timeout_s, op_fn fn, int need_regs,
                           int need_pages) {
    return run_batch_arg(p, keys, regions, timeout_s, fn, need_regs, need_pages, 0, batch_result);
}

static PyObject *Pool_pin(Pool *p, PyObject *args) {
    PyObject *keys;
    double lease, t;
    if (!PyArg_ParseTuple(args, "Odd", &keys, &lease, &t)) return NULL;
    if (!(lease > 0 && lease <= 3600)) {
        PyErr_SetString(PyExc_ValueError, "lease_s must be > 0 and <= 3600 (pins are short leases)");
        return NULL;
    }
    return run_batch_arg(p, keys, NULL, t, op_pin, 0, 0, (uint64_t)(lease * 1e9), batch_result);
}

/* pin_breaks() -> int: the pool's count of pinned objects that left it other
 * than by a newer value (see hdr_t), read without the lock; -1 once the pool is
 * closed or destroyed. A lookup that holds a run pinned when this read N need not
 * probe that run again while it reads N. */
static PyObject *Pool_pin_breaks(Pool *p, PyObject *unused) {
    (void)unused;
    if (enter(p) < 0) return PyLong_FromLong(-1);
    long long n = atomic_load(&p->h->destroyed) ? -1 : (long long)__atomic_load_n(&p->h->pin_breaks, __ATOMIC_ACQUIRE);
    leave(p);
    return PyLong_FromLongLong(n);
}

/* (status, objects pinned now by a live process): tests and doctor check that
 * lookups leave no pins behind. A scan of the key table under the lock. */
static PyObject *Pool_pinned(Pool *p, PyObject *args) {
    double t;
    if (!PyArg_ParseTuple(args, "d", &t)) return NULL;
    if (enter(p) < 0) return Py_BuildValue("(Nn)", status_obj(ST_UNAVAILABLE), (Py_ssize_t)0);
    Py_ssize_t n = 0;
    int st;
    double deadline = arg_deadline(t);
    Py_BEGIN_ALLOW_THREADS
    st = ensure_slot(p, deadline);
    if (!st) st = pool_lock(p, deadline);
    if (!st) {
        entry_t *E = ENT(p);
        uint64_t now = now_ns();
        for (uint32_t i = 0; i < p->h->entries_hwm; i++) {
            entry_t *e = &E[i];
            if (e->state != E_LIVE && e->state != E_DISK && e->state != E_SPILLING) continue;
            if (e->pin_until && entry_pinned(p, e, now)) n++;
        }
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    return Py_BuildValue("(Nn)", status_obj(st), st ? (Py_ssize_t)0 : n);
}

static PyObject *Pool_unpin(Pool *p, PyObject *args) {
    PyObject *keys;
    double t;
    if (!PyArg_ParseTuple(args, "Od", &keys, &t)) return NULL;
    return run_batch(p, keys, NULL, t, op_unpin, 0, 0);
}

static PyObject *Pool_exists(Pool *p, PyObject *args) {
    PyObject *keys;
    double t;
    if (!PyArg_ParseTuple(args, "Od", &keys, &t)) return NULL;
    return run_batch(p, keys, NULL, t, op_exists, 0, 0);
}

static PyObject *Pool_put(Pool *p, PyObject *args) {
    PyObject *keys, *regs;
    double t;
    if (!PyArg_ParseTuple(args, "OOd", &keys, &regs, &t)) return NULL;
    return run_batch(p, keys, regs, t, op_put, 1, 1);
}

static PyObject *Pool_put_absent(Pool *p, PyObject *args) {
    PyObject *keys, *regs;
    double t;
    if (!PyArg_ParseTuple(args, "OOd", &keys, &regs, &t)) return NULL;
    return run_batch_arg(p, keys, regs, t, op_put, 1, 1, PUT_ABSENT, batch_result_present);
}

static PyObject *Pool_get(Pool *p, PyObject *args) {
    PyObject *keys, *regs;
    double t;
    if (!PyArg_ParseTuple(args, "OOd", &keys, &regs, &t)) return NULL;
    return run_batch(p, keys, regs, t, op_get, 1, 1);
}

static PyObject *Pool_remove(Pool *p, PyObject *args) {
    PyObject *keys;
    double t;
    if (!PyArg_ParseTuple(args, "Od", &keys, &t)) return NULL;
    return run_batch(p, keys, NULL, t, op_remove, 0, 0);
}

/* Scan entries under the lock: remove (mode 1) or list (mode 0) by prefix. */
static PyObject *Pool_scan(Pool *p, PyObject *args) {
    const char *prefix;
    Py_ssize_t plen;
    int remove;
    Py_ssize_t limit;
    double t;
    if (!PyArg_ParseTuple(args, "s#pnd", &prefix, &plen, &remove, &limit, &t)) return NULL;
    if (enter(p) < 0) {
        if (remove) return Py_BuildValue("(Nn)", status_obj(ST_UNAVAILABLE), (Py_ssize_t)0);
        return Py_BuildValue("(NN)", status_obj(ST_UNAVAILABLE), PyList_New(0));
    }
    char *pre = malloc(plen + 1);
    memcpy(pre, prefix, plen);
    size_t cap = 64, n = 0, bytes = 0;
    char *buf = NULL;
    uint32_t *lens = NULL;
    int st;
    double deadline = arg_deadline(t);
    Py_BEGIN_ALLOW_THREADS
    st = ensure_slot(p, deadline);
    if (!st) st = pool_lock(p, deadline);
    if (!st) {
        entry_t *E = ENT(p);
        size_t bcap = 4096;
        buf = malloc(bcap);
        lens = malloc(sizeof(uint32_t) * cap);
        for (uint32_t i = 0; i < p->h->entries_hwm && (limit < 0 || (Py_ssize_t)n < limit); i++) {
            entry_t *e = &E[i];
            if ((e->state != E_LIVE && e->state != E_DISK && e->state != E_SPILLING) || e->keylen < (uint32_t)plen ||
                memcmp(e->key, pre, plen) != 0)
                continue;
            if (remove) {
                entry_remove(p, i, R_REMOVED);
                n++;
                continue;
            }
            if (n == cap) {
                cap *= 2;
                lens = realloc(lens, sizeof(uint32_t) * cap);
            }
            if (bytes + e->keylen > bcap) {
                while (bytes + e->keylen > bcap) bcap *= 2;
                buf = realloc(buf, bcap);
            }
            memcpy(buf + bytes, e->key, e->keylen);
            bytes += e->keylen;
            lens[n++] = e->keylen;
        }
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    free(pre);
    PyObject *res;
    if (remove || st) {
        res = Py_BuildValue("(Nn)", status_obj(st), (Py_ssize_t)(st ? 0 : n));
    } else {
        PyObject *lst = PyList_New((Py_ssize_t)n);
        size_t o = 0;
        for (size_t k = 0; k < n; k++) {
            PyList_SET_ITEM(lst, k, PyUnicode_DecodeUTF8(buf + o, lens[k], "replace"));
            o += lens[k];
        }
        res = Py_BuildValue("(NN)", status_obj(ST_OK), lst);
    }
    free(buf);
    free(lens);
    return res;
}

/* ------------------------------------------------------------------ prefix scan (lookup)
 *
 * prefix_run(prefixes, suffixes, gallop, timeout_s, lease_s=0) -> (Status, chunks, probes)
 *
 * suffixes: str, or bytes (a raw chained hash; its lowercase hex is used, so
 * the scheduler need not build a hex string per chunk).
 * Chunk i is present when every key prefix + suffixes[i] (for each prefix) is
 * in the pool. Returns how many chunks from 0 are present as an unbroken run:
 * the scheduler's lookup of a prompt in one call, with no key strings or status
 * lists built in Python. Keys are hashed before the lock is taken (the hash state
 * after each prefix is computed once); found keys are touched as exists does.
 *
 * gallop=0: one probe per chunk up to the first miss (exact).
 * gallop=1: chained keys have the prefix property (chunk i was saved only after
 * chunks < i), so probe chunks 0, 1, 3, 7, ... until a miss, then bisect between
 * the last hit and that miss: O(log n) probes. An eviction hole below a probed
 * hit is not seen (the run is overcounted; the load of the hole then fails and
 * those tokens are recomputed). probes counts chunks examined.
 *
 * lease_s > 0: the chunks counted are also pinned (as pin() does) in the same
 * pass, and the count is exactly what was pinned (with gallop every chunk of
 * the run is then looked at, so no overcount). unpin_run lets them go. */
typedef struct {
    const char *buf;       /* prefixes then suffixes, copied (the GIL is released) */
    uint32_t np, n;
    uint32_t *poff, *plen; /* np */
    kh_t *pstate;          /* key-hash state after each prefix */
    uint32_t *soff, *slen; /* n */
} prefix_req_t;

/* Entries of the chunks found present, touched after the scan (see scan_touch). */
typedef struct {
    uint32_t chunk, idx;
    uint64_t version;
} seen_t;

/* 1 if every key of chunk i is present (recording their entries in seen), else 0;
 * hashes: the chunk's np precomputed hashes or NULL. */
static int chunk_present(Pool *p, const prefix_req_t *q, uint32_t i, const uint64_t *hashes, seen_t *seen,
                         size_t *nseen) {
    uint32_t sl = q->slen[i];
    const char *s = q->buf + q->soff[i];
    size_t n0 = *nseen;
    for (uint32_t j = 0; j < q->np; j++) {
        uint32_t pl = q->plen[j], kl = pl + sl;
        if (kl == 0 || kl > MAX_KEY) break; /* cannot be stored: absent */
        uint64_t hv = hashes ? hashes[j] : kh_more(q->pstate[j], s, sl);
        uint32_t e = find2(p, q->buf + q->poff[j], pl, s, sl, hv);
        if (e == NONE32) break;
        seen[(*nseen)++] = (seen_t){i, e, ENT(p)[e].version};
    }
    if (*nseen - n0 == q->np) return 1;
    *nseen = n0; /* a chunk partly present is not loadable: not touched */
    return 0;
}

static int cmp_seen_desc(const void *a, const void *b) {
    uint32_t x = ((const seen_t *)a)->chunk, y = ((const seen_t *)b)->chunk;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* 1 if the entries seen (in chunk order, none replaced, all in DRAM) already
 * open the LRU list in that order: what touching them last chunk first would
 * make. A waiting request is looked up every step; when nothing else was touched
 * in between, its run is still there, and touching it again would rewrite the
 * links of ~3 entries per key (the raw exists does) for the same order. Their
 * ticks stay in the same order too (a rebuild after a crash orders by tick). */
static int run_at_lru_head(Pool *p, const seen_t *seen, size_t nseen) {
    entry_t *E = ENT(p);
    uint32_t want = p->h->lru_head;
    for (size_t k = 0; k < nseen; k++) {
        const entry_t *e = &E[seen[k].idx];
        if (seen[k].idx != want || e->version != seen[k].version || e->state != E_LIVE) return 0;
        want = e->next;
    }
    return 1;
}

/* LRU-touch the entries found, last chunk first: chunk 0 of a prompt ends up the
 * most recently used, so LRU evicts a prefix from its tail and what stays is
 * still a prefix (evicting chunk 0 first would strand every later chunk).
 * Entries replaced since they were seen (another version) are skipped. Lock held. */
static void scan_touch(Pool *p, seen_t *seen, size_t nseen, int sorted) {
    if (sorted && run_at_lru_head(p, seen, nseen)) return;
    if (!sorted) qsort(seen, nseen, sizeof *seen, cmp_seen_desc);
    entry_t *E = ENT(p);
    for (size_t k = 0; k < nseen; k++) {
        const seen_t *v = sorted ? &seen[nseen - 1 - k] : &seen[k];
        if (E[v->idx].version == v->version) touch(p, v->idx);
    }
}

/* The hash of prefix j + suffix i; 0 for a key longer than MAX_KEY, which no entry
 * has (prefix_req_parse copies no bytes of an overlong prefix or suffix, so hashing
 * them would read past its buffer; every probe skips such a key by its length). */
static inline uint64_t req_key_hash(const prefix_req_t *q, uint32_t i, uint32_t j) {
    if (q->plen[j] + q->slen[i] > MAX_KEY) return 0;
    return kh_more(q->pstate[j], q->buf + q->soff[i], q->slen[i]);
}

static void prefix_req_free(prefix_req_t *q, char *buf) {
    free(q->poff);
    free(q->pstate);
    free(q->soff);
    free(buf);
}

/* The lowercase hex of n raw bytes (2n chars). A scheduler's lookup passes a
 * prompt's raw chunk hashes (32 bytes each): with SSE2 (every x86-64), 16 bytes
 * become 32 digits in a handful of vector ops instead of 32 byte-pair stores. */
#if defined(__SSE2__)
#include <emmintrin.h>
static inline __m128i hex_digits(__m128i nib) {
    __m128i letter = _mm_and_si128(_mm_cmpgt_epi8(nib, _mm_set1_epi8(9)), _mm_set1_epi8('a' - '0' - 10));
    return _mm_add_epi8(_mm_add_epi8(nib, _mm_set1_epi8('0')), letter);
}
#endif

static void hex_encode(char *out, const uint8_t *in, size_t n) {
    static const char hexd[] = "0123456789abcdef";
    size_t i = 0;
#if defined(__SSE2__)
    for (; i + 16 <= n; i += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(in + i)), m = _mm_set1_epi8(0x0f);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m), lo = _mm_and_si128(v, m);
        _mm_storeu_si128((__m128i *)(out + 2 * i), hex_digits(_mm_unpacklo_epi8(hi, lo)));
        _mm_storeu_si128((__m128i *)(out + 2 * i + 16), hex_digits(_mm_unpackhi_epi8(hi, lo)));
    }
#endif
    for (; i < n; i++) {
        out[2 * i] = hexd[in[i] >> 4];
        out[2 * i + 1] = hexd[in[i] & 15];
    }
}

/* Copy (prefixes, suffixes) into q and a buffer of their bytes (*bufp), so the
 * GIL can be released; the key-hash state after each prefix is computed here. Returns
 * -1 with an exception set on bad input (the caller frees with prefix_req_free). */
static int prefix_req_parse(PyObject *prefs, PyObject *sufs, const char *fn, prefix_req_t *q, char **bufp) {
    int rc = -1;
    PyObject *pf = PySequence_Fast(prefs, "prefixes must be a sequence of str");
    if (!pf) return -1;
    PyObject *sf = PySequence_Fast(sufs, "suffixes must be a sequence of str or bytes");
    if (!sf) {
        Py_DECREF(pf);
        return -1;
    }
    Py_ssize_t np = PySequence_Fast_GET_SIZE(pf), n = PySequence_Fast_GET_SIZE(sf);
    char *buf = NULL;
    const char **src = NULL; /* each item's bytes (held by the sequences); a raw hash's are hex-encoded */
    if (np < 1 || np > 1 << 16 || n > 1 << 24) {
        PyErr_Format(PyExc_ValueError, "%s: 1..65536 prefixes and at most 2^24 suffixes", fn);
        goto out;
    }
    q->np = (uint32_t)np;
    q->n = (uint32_t)n;
    q->poff = malloc(sizeof(uint32_t) * 2 * np);
    q->pstate = malloc(sizeof(kh_t) * np);
    q->soff = malloc(sizeof(uint32_t) * 2 * (n + 1));
    src = malloc(sizeof(char *) * (np + n));
    if (!q->poff || !q->pstate || !q->soff || !src) {
        PyErr_NoMemory();
        goto out;
    }
    q->plen = q->poff + np;
    q->slen = q->soff + n + 1;
    /* One pass over the Python objects: lengths and where their bytes are (an ASCII
     * str, every key here, is read in place without a call); then one copy. */
    size_t tot = 0;
    for (Py_ssize_t k = 0; k < np + n; k++) {
        PyObject *o = k < np ? PySequence_Fast_GET_ITEM(pf, k) : PySequence_Fast_GET_ITEM(sf, k - np);
        Py_ssize_t l;
        if (k >= np && PyBytes_Check(o)) {
            l = 2 * PyBytes_GET_SIZE(o); /* a raw hash: its lowercase hex is the suffix */
            src[k] = NULL;
        } else if (PyUnicode_Check(o) && PyUnicode_IS_COMPACT_ASCII(o)) {
            l = PyUnicode_GET_LENGTH(o);
            src[k] = (const char *)PyUnicode_DATA(o);
        } else if (!PyUnicode_Check(o) || !(src[k] = PyUnicode_AsUTF8AndSize(o, &l))) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s: prefixes must be str, suffixes str or bytes", fn);
            goto out;
        }
        if (l > MAX_KEY) l = MAX_KEY + 1; /* such a key is never present; keep the length only */
        if (k < np) q->plen[k] = (uint32_t)l;
        else q->slen[k - np] = (uint32_t)l;
        tot += l > MAX_KEY ? 0 : l;
    }
    buf = malloc(tot + 1);
    if (!buf) {
        PyErr_NoMemory();
        goto out;
    }
    size_t o = 0;
    for (Py_ssize_t k = 0; k < np + n; k++) {
        uint32_t l = k < np ? q->plen[k] : q->slen[k - np];
        uint32_t *off = k < np ? &q->poff[k] : &q->soff[k - np];
        *off = (uint32_t)o;
        if (l > MAX_KEY) continue;
        if (src[k]) {
            memcpy(buf + o, src[k], l);
        } else {
            hex_encode(buf + o, (const uint8_t *)PyBytes_AS_STRING(PySequence_Fast_GET_ITEM(sf, k - np)), l / 2);
        }
        o += l;
    }
    q->buf = buf;
    for (uint32_t j = 0; j < q->np; j++) {
        kh_init(&q->pstate[j]);
        if (q->plen[j] <= MAX_KEY) /* (a longer one's bytes were not copied: no key has it) */
            kh_update(&q->pstate[j], buf + q->poff[j], q->plen[j]);
    }
    rc = 0;
out:
    free(src);
    *bufp = buf;
    Py_DECREF(pf);
    Py_DECREF(sf);
    return rc;
}

/* Pin the entries of a run found by a scan (seen: every key of chunks
 * [0, hits), in chunk order) until ``until``. The lock is dropped between a
 * linear scan's blocks, so an entry may have been replaced since it was seen
 * (another version: removed, evicted, spilled); the run ends at that chunk, so
 * what a lookup counts is exactly what it pinned. Returns the run. Lock held. */
static Py_ssize_t scan_pin(Pool *p, const seen_t *seen, size_t nseen, Py_ssize_t hits, uint64_t until) {
    entry_t *E = ENT(p);
    for (size_t k = 0; k < nseen; k++) {
        if (E[seen[k].idx].version != seen[k].version) {
            if ((Py_ssize_t)seen[k].chunk < hits) hits = (Py_ssize_t)seen[k].chunk;
            break;
        }
    }
    uint64_t now = now_ns();
    for (size_t k = 0; k < nseen && (Py_ssize_t)seen[k].chunk < hits; k++) pin_entry(p, &E[seen[k].idx], now, until);
    return hits;
}

static PyObject *Pool_prefix_run(Pool *p, PyObject *args) {
    PyObject *prefs, *sufs;
    int gallop;
    double t, lease = 0.0;
    if (!PyArg_ParseTuple(args, "OOpd|d", &prefs, &sufs, &gallop, &t, &lease)) return NULL;
    if (lease != 0.0 && !(lease > 0 && lease <= 3600)) {
        PyErr_SetString(PyExc_ValueError, "lease_s must be 0 (no pin) or > 0 and <= 3600 (pins are short leases)");
        return NULL;
    }
    PyObject *res = NULL;
    prefix_req_t q = {0};
    char *buf = NULL;
    uint64_t *hashes = NULL;
    seen_t *seen = NULL;
    size_t nseen = 0;
    if (prefix_req_parse(prefs, sufs, "prefix_run", &q, &buf) < 0) goto out;
    Py_ssize_t np = q.np, n = q.n;
    uint64_t lease_ns = (uint64_t)(lease * 1e9);
    /* gallop records only its probes (~2 log2(n)); pinning needs every chunk of the run */
    seen = malloc(sizeof(seen_t) * np * (gallop && !lease_ns ? 128 : n + 1));
    if (!gallop && n) hashes = malloc(sizeof(uint64_t) * np * n);
    if (!seen || (!gallop && n && !hashes)) {
        PyErr_NoMemory();
        goto out;
    }
    int st = ST_OK;
    Py_ssize_t hits = 0, probes = 0;
    if (enter(p) < 0) {
        st = ST_UNAVAILABLE;
    } else {
        double deadline = arg_deadline(t);
        Py_BEGIN_ALLOW_THREADS
        double slow = atomic_load(&p->delay_s);
        if (slow > 0) { /* simulated slow store, as for the batch calls */
            double left = deadline - now_mono();
            if (left < 0) left = 0;
            usleep((useconds_t)((slow < left ? slow : left) * 1e6));
            if (slow >= left) st = ST_TIMEOUT;
        }
        if (!st) st = ensure_slot(p, deadline);
        if (!st && !gallop) {
            /* Keys are hashed outside the lock in growing blocks (16, 64, 256, ...
             * chunks), each probed under the lock: a miss early costs little. */
            uint32_t hashed = 0, block = 16;
            while (!st && (uint32_t)hits == hashed && hashed < q.n) {
                double stall = hashed ? atomic_load(&p->scan_stall_s) : 0;
                if (stall > 0) usleep((useconds_t)(stall * 1e6));
                uint32_t end = q.n - hashed < block ? q.n : hashed + block;
                for (uint32_t i = hashed; i < end; i++)
                    for (uint32_t j = 0; j < q.np; j++)
                        hashes[(size_t)i * q.np + j] = req_key_hash(&q, i, j);
                hashed = end;
                block *= 4;
                if ((st = pool_lock(p, deadline))) break;
                /* (the keys not probed yet, chunk-major: the run so far hit every one) */
                Py_ssize_t from = hits;
                uint64_t *todo = hashes + (size_t)from * q.np;
                size_t ntodo = (size_t)(hashed - (uint32_t)from) * q.np;
#define TODO_HASH(k) (todo[k])
                while ((uint32_t)hits < hashed) {
                    for (size_t k = (size_t)(hits - from) * q.np, e = k + q.np; k < e; k++)
                        PROBE_AHEAD(p, k, ntodo, TODO_HASH);
                    probes++;
                    if (!chunk_present(p, &q, (uint32_t)hits, hashes + (size_t)hits * q.np, seen, &nseen)) break;
                    hits++;
                }
#undef TODO_HASH
                if ((uint32_t)hits < hashed || hashed == q.n) { /* the last block */
                    if (lease_ns) hits = scan_pin(p, seen, nseen, hits, now_ns() + lease_ns);
                    scan_touch(p, seen, nseen, 1);
                }
                pool_unlock(p);
            }
        } else if (!st && q.n) {
            if (!(st = pool_lock(p, deadline))) {
                /* lo: a run of lo chunks is believed present; hi: chunk hi is absent (or n) */
                uint64_t lo = 0, hi = q.n, step = 1;
                for (;;) {
                    uint64_t i = lo + step - 1; /* probe the last chunk of the next block */
                    if (i >= q.n) i = q.n - 1;
                    probes++;
                    if (!chunk_present(p, &q, (uint32_t)i, NULL, seen, &nseen)) {
                        hi = i;
                        break;
                    }
                    lo = i + 1;
                    if (lo >= q.n) break;
                    step *= 2;
                }
                while (lo < hi) {
                    uint64_t mid = lo + (hi - lo) / 2;
                    probes++;
                    if (chunk_present(p, &q, (uint32_t)mid, NULL, seen, &nseen)) lo = mid + 1;
                    else hi = mid;
                }
                hits = (Py_ssize_t)lo;
                if (lease_ns) {
                    /* A pin holds exactly what is counted: every chunk of the run is
                     * looked at, so a hole below a probe ends the run (no overcount). */
                    nseen = 0;
                    Py_ssize_t i = 0;
                    while (i < hits && chunk_present(p, &q, (uint32_t)i, NULL, seen, &nseen)) i++;
                    hits = scan_pin(p, seen, nseen, i, now_ns() + lease_ns);
                    scan_touch(p, seen, nseen, 1);
                } else {
                    scan_touch(p, seen, nseen, 0);
                }
                pool_unlock(p);
            }
        }
        Py_END_ALLOW_THREADS
        leave(p);
    }
    res = Py_BuildValue("(Nnn)", status_obj(st), st == ST_OK ? hits : (Py_ssize_t)0, probes);
out:
    prefix_req_free(&q, buf);
    free(hashes);
    free(seen);
    return res;
}

/* unpin_run(prefixes, suffixes, timeout_s) -> Status: drop this process's pins
 * of every key prefix + suffixes[i] (what prefix_run pinned), without a key
 * string per object in Python. Absent keys are skipped; shared pins end with
 * their lease. */
static PyObject *Pool_unpin_run(Pool *p, PyObject *args) {
    PyObject *prefs, *sufs;
    double t;
    if (!PyArg_ParseTuple(args, "OOd", &prefs, &sufs, &t)) return NULL;
    prefix_req_t q = {0};
    char *buf = NULL;
    uint64_t *hashes = NULL;
    PyObject *res = NULL;
    if (prefix_req_parse(prefs, sufs, "unpin_run", &q, &buf) < 0) goto out;
    size_t nk = (size_t)q.np * q.n;
    if (nk && !(hashes = malloc(sizeof(uint64_t) * nk))) {
        PyErr_NoMemory();
        goto out;
    }
    int st = ST_OK;
    if (enter(p) < 0) {
        st = ST_UNAVAILABLE;
    } else {
        double deadline = arg_deadline(t);
        Py_BEGIN_ALLOW_THREADS
        for (uint32_t i = 0; i < q.n; i++)
            for (uint32_t j = 0; j < q.np; j++)
                hashes[(size_t)i * q.np + j] = req_key_hash(&q, i, j);
        st = ensure_slot(p, deadline);
        if (!st && nk && !(st = pool_lock(p, deadline))) {
            char key[MAX_KEY];
#define RUN_HASH(k) (hashes[k])
            for (uint32_t i = 0; i < q.n; i++) {
                for (uint32_t j = 0; j < q.np; j++) {
                    PROBE_AHEAD(p, (size_t)i * q.np + j, nk, RUN_HASH);
                    uint32_t pl = q.plen[j], sl = q.slen[i], kl = pl + sl;
                    if (kl == 0 || kl > MAX_KEY) continue;
                    memcpy(key, buf + q.poff[j], pl);
                    memcpy(key + pl, buf + q.soff[i], sl);
                    uint32_t x = find(p, key, kl, hashes[(size_t)i * q.np + j]);
                    if (x != NONE32) unpin_entry(p, &ENT(p)[x]);
                }
            }
#undef RUN_HASH
            pool_unlock(p);
        }
        Py_END_ALLOW_THREADS
        leave(p);
    }
    res = status_obj(st);
out:
    prefix_req_free(&q, buf);
    free(hashes);
    return res;
}

/* removed_since(cursor, limit, timeout_s) -> (Status, next_cursor, [(seq, key, tier, reason, moved_to)], lost).
 * cursor: the sequence number of the next record wanted; -1: from now on. */
static PyObject *Pool_removed_since(Pool *p, PyObject *args) {
    long long cursor;
    Py_ssize_t limit;
    double t;
    if (!PyArg_ParseTuple(args, "Lnd", &cursor, &limit, &t)) return NULL;
    if (limit < 0) limit = 0;
    if (enter(p) < 0) return Py_BuildValue("(NLNn)", status_obj(ST_UNAVAILABLE), cursor, PyList_New(0), (Py_ssize_t)0);
    int st;
    uint64_t next = 0, lost = 0, n = 0;
    event_t *buf = NULL;
    double deadline = arg_deadline(t);
    Py_BEGIN_ALLOW_THREADS
    st = ensure_slot(p, deadline);
    if (!st) st = pool_lock(p, deadline);
    if (!st) {
        hdr_t *h = p->h;
        uint64_t head = h->ev_next, oldest = head > h->ev_cap ? head - h->ev_cap : 0;
        uint64_t from;
        if (cursor < 0) from = head;
        else if ((uint64_t)cursor > head) from = oldest; /* a cursor of an earlier pool of this name */
        else if ((uint64_t)cursor < oldest) {
            lost = oldest - (uint64_t)cursor; /* overwritten before this reader came back */
            from = oldest;
        } else from = (uint64_t)cursor;
        n = head - from;
        if (n > (uint64_t)limit) n = (uint64_t)limit;
        buf = n ? malloc(sizeof(event_t) * n) : NULL;
        if (n && !buf) n = 0;
        for (uint64_t k = 0; k < n; k++) buf[k] = EVENTS(p)[(from + k) & (h->ev_cap - 1)];
        next = from + n;
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    if (st) return Py_BuildValue("(NLNn)", status_obj(st), cursor, PyList_New(0), (Py_ssize_t)0);
    static const char *tiers[] = {"cpu", "disk"};
    static const char *reasons[] = {"", "evicted", "removed", "spilled", "promoted", "lost"};
    PyObject *lst = PyList_New((Py_ssize_t)n);
    for (uint64_t k = 0; lst && k < n; k++) {
        event_t *ev = &buf[k];
        PyObject *moved = ev->moved_to <= TIER_DISK ? PyUnicode_FromString(tiers[ev->moved_to]) : Py_NewRef(Py_None);
        PyObject *item = Py_BuildValue("(KNssN)", (unsigned long long)ev->seq,
                                       PyUnicode_DecodeUTF8(ev->key, ev->keylen, "replace"),
                                       tiers[ev->tier <= TIER_DISK ? ev->tier : 0],
                                       reasons[ev->reason <= R_LOST ? ev->reason : 0], moved);
        if (!item) {
            Py_CLEAR(lst);
            break;
        }
        PyList_SET_ITEM(lst, (Py_ssize_t)k, item);
    }
    free(buf);
    if (!lst) return NULL;
    return Py_BuildValue("(NKNK)", status_obj(ST_OK), (unsigned long long)next, lst, (unsigned long long)lost);
}

static uint64_t shm_resident(Pool *p) {
    struct stat sb;
    int fd = arena_open(p, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return 0;
    uint64_t r = fstat(fd, &sb) == 0 ? (uint64_t)sb.st_blocks * 512 : 0;
    close(fd);
    return r;
}

static PyObject *Pool_stats(Pool *p, PyObject *args) {
    double t;
    if (!PyArg_ParseTuple(args, "d", &t)) return NULL;
    if (enter(p) < 0) return Py_BuildValue("(NN)", status_obj(ST_UNAVAILABLE), PyDict_New());
    hdr_t snap;
    int live = 0, st;
    double deadline = arg_deadline(t);
    Py_BEGIN_ALLOW_THREADS
    st = ensure_slot(p, deadline);
    if (!st) st = pool_lock(p, deadline);
    if (!st) {
        memcpy(&snap, p->h, sizeof snap);
        slot_t *S = SLOTS(p);
        for (int s = 0; s < MAX_PROCS; s++) live += S[s].in_use;
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    uint64_t resident = st ? 0 : shm_resident(p);
    leave(p);
    if (st) return Py_BuildValue("(NN)", status_obj(st), PyDict_New());
    uint64_t P = snap.page_size;
    PyObject *d = PyDict_New();
#define PUT(k, v)                                                   \
    do {                                                            \
        PyObject *o_ = PyLong_FromUnsignedLongLong((uint64_t)(v)); \
        PyDict_SetItemString(d, k, o_);                             \
        Py_DECREF(o_);                                              \
    } while (0)
    PyObject *nm = PyUnicode_FromString(snap.name);
    PyDict_SetItemString(d, "shm_name", nm);
    Py_DECREF(nm);
    PUT("capacity_bytes", (uint64_t)snap.n_pages * P);
    PUT("page_size", P);
    PUT("used_bytes", (uint64_t)(snap.n_pages - snap.free_pages) * P);
    PUT("pages_total", snap.n_pages);
    PUT("pages_free", snap.free_pages);
    PUT("pages_reserved", snap.reserved_pages);
    PUT("objects", snap.n_live);
    PUT("object_bytes", snap.live_bytes);
    PUT("disk_objects", snap.n_disk);
    PUT("max_keys", snap.max_keys);
    PUT("keys_used", snap.entries_used);
    PUT("disk_capacity_bytes", snap.disk_capacity);
    PUT("disk_file_bytes", snap.disk_file_bytes);
    PUT("disk_object_bytes", snap.disk_live_bytes);
    PUT("hits", snap.c_hits);
    PUT("misses", snap.c_misses);
    PUT("puts", snap.c_puts);
    PUT("evictions", snap.c_evictions);
    PUT("spills", snap.c_spills);
    PUT("clean_spills", snap.c_clean_spills);
    PUT("disk_hits", snap.c_disk_hits);
    PUT("promotions", snap.c_promotions);
    PUT("disk_drops", snap.c_disk_drops);
    PUT("corrupt", snap.c_corrupt);
    PUT("no_space", snap.c_no_space);
    PUT("lock_recoveries", snap.c_lock_recoveries);
    PUT("dead_reservations_reclaimed", snap.c_dead_reclaimed);
    PUT("read_retries", snap.c_retries);
    PUT("processes", live);
    PUT("removal_records", snap.ev_next);
    PUT("pins", snap.c_pins);
    PUT("pinned_skips", snap.c_pinned_skips);
    PUT("removal_ring", snap.ev_cap);
    PUT("shm_resident_bytes", resident);
    PUT("shm_size_bytes", snap.total_size);
#undef PUT
    return Py_BuildValue("(NN)", status_obj(ST_OK), d);
}

/* Check every invariant (after sweeping dead processes). Returns a list of problems. */
static PyObject *Pool_check(Pool *p, PyObject *args) {
    double t;
    if (!PyArg_ParseTuple(args, "d", &t)) return NULL;
    if (enter(p) < 0) return PyErr_Format(PyExc_RuntimeError, "pool closed");
    char msg[4096] = {0};
    size_t ml = 0;
#define PROBLEM(...) ml += snprintf(msg + ml, ml < sizeof msg ? sizeof msg - ml : 0, __VA_ARGS__)
    int st;
    double deadline = arg_deadline(t);
    Py_BEGIN_ALLOW_THREADS
    st = pool_lock(p, deadline);
    if (!st) {
        sweep_dead(p);
        hdr_t *h = p->h;
        entry_t *E = ENT(p);
        uint32_t *nx = NEXT(p);
        uint8_t *seen = calloc(h->n_pages + 1, 1);
        uint32_t owned = 0, nl = 0, nsp = 0, nd = 0, nr = 0, used = 0, rp = 0, nc = 0;
        for (uint32_t i = 0; i < h->entries_hwm; i++) {
            entry_t *e = &E[i];
            if (e->state == E_FREE) continue;
            used++;
            if (e->state == E_LIVE) nl++;
            if (e->state == E_SPILLING) nsp++;
            if (e->state == E_DISK) nd++;
            if (e->on_disk && e->state == E_LIVE) nc++;
            if (e->on_disk != (e->state == E_DISK) && !(e->on_disk && e->state == E_LIVE))
                PROBLEM("entry %u in state %u %s a disk copy; ", i, e->state, e->on_disk ? "claims" : "lacks");
            if (e->state == E_RESERVED) {
                nr++;
                rp += e->npages;
            }
            int hashed = e->state == E_LIVE || e->state == E_DISK || e->state == E_SPILLING;
            if (hashed && find(p, e->key, e->keylen, e->hash) != i)
                PROBLEM("entry %u not reachable by its key; ", i);
            uint32_t pg = e->first_page;
            for (uint32_t k = 0; k < e->npages; k++, pg = nx[pg]) {
                if (pg >= h->n_pages || seen[pg]) {
                    PROBLEM("entry %u bad/shared page; ", i);
                    break;
                }
                seen[pg] = 1;
                owned++;
            }
        }
        uint32_t nfree = 0;
        for (uint32_t pg = h->free_page_head; pg != NONE32 && nfree <= h->n_pages; pg = nx[pg]) {
            if (seen[pg]) {
                PROBLEM("free page %u also owned; ", pg);
                break;
            }
            seen[pg] = 1;
            nfree++;
        }
        if (nfree != h->free_pages) PROBLEM("free list %u != counter %u; ", nfree, h->free_pages);
        if (owned + nfree != h->n_pages) PROBLEM("pages leaked: owned %u + free %u != %u; ", owned, nfree, h->n_pages);
        if (nl + nsp != h->n_live) PROBLEM("live %u + spilling %u != counter %u; ", nl, nsp, h->n_live);
        if (nd != h->n_disk) PROBLEM("disk %u != counter %u; ", nd, h->n_disk);
        if (rp != h->reserved_pages) PROBLEM("reserved pages %u != counter %u; ", rp, h->reserved_pages);
        if (used != h->entries_used) PROBLEM("entries %u != counter %u; ", used, h->entries_used);
        uint32_t cnt = 0, last = NONE32;
        int lru_links = 0;
        for (uint32_t i = h->lru_head; i != NONE32 && cnt <= h->max_keys; last = i, i = E[i].next) {
            cnt++;
            if (!lru_links && (E[i].prev != last || E[i].state != E_LIVE)) {
                PROBLEM("lru list broken at %u (back link %u, want %u; state %u); ", i, E[i].prev, last, E[i].state);
                lru_links = 1;
            }
        }
        if (cnt != nl) PROBLEM("lru length %u != live %u; ", cnt, nl);
        if (cnt <= h->max_keys && h->lru_tail != last) PROBLEM("lru tail %u != last %u; ", h->lru_tail, last);
        cnt = 0;
        int disorder = 0, dropped = 0;
        for (uint32_t i = h->disk_head, prev = NONE32; i != NONE32 && cnt <= h->max_keys; prev = i, i = E[i].dnext) {
            cnt++;
            if (E[i].dprev != prev) PROBLEM("disk list back link broken at %u; ", i);
            if (!E[i].on_disk) PROBLEM("entry %u in the disk list without a disk copy; ", i);
            if (E[i].disk_seg < h->disk_first_seg) dropped++;
            if (prev != NONE32 && (E[prev].disk_seg < E[i].disk_seg ||
                                   (E[prev].disk_seg == E[i].disk_seg && E[prev].disk_off < E[i].disk_off)))
                disorder++;
        }
        if (cnt != nd + nc) PROBLEM("disk list length %u != disk %u + clean copies %u; ", cnt, nd, nc);
        if (disorder) PROBLEM("disk list out of position order at %d places; ", disorder);
        if (dropped) PROBLEM("%d disk objects in dropped segments; ", dropped);
        if (h->disk_file_bytes > h->disk_capacity) PROBLEM("disk bytes over capacity; ");
        free(seen);
        (void)nr;
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    if (st) return PyErr_Format(PyExc_TimeoutError, "could not lock the pool (status %d)", st);
    return PyUnicode_FromString(msg);
#undef PROBLEM
}

/* Test hook: flip one byte of a stored object (in DRAM or on disk). */
static PyObject *Pool_debug_corrupt(Pool *p, PyObject *args) {
    const char *key;
    Py_ssize_t klen;
    unsigned long long off = 0;
    if (!PyArg_ParseTuple(args, "s#|K", &key, &klen, &off)) return NULL;
    if (enter(p) < 0) Py_RETURN_FALSE;
    int done = 0;
    Py_BEGIN_ALLOW_THREADS
    if (pool_lock(p, now_mono() + 5) == ST_OK) {
        uint32_t i = find(p, key, (uint32_t)klen, key_hash(key, klen));
        if (i != NONE32 && ENT(p)[i].size > 0) {
            entry_t *e = &ENT(p)[i];
            uint64_t o = off % e->size, P = p->h->page_size;
            if (e->state == E_LIVE || e->state == E_SPILLING) {
                uint32_t pg = e->first_page;
                for (uint64_t k = 0; k < o / P; k++) pg = NEXT(p)[pg];
                ARENA(p)[(uint64_t)pg * P + o % P] ^= 0x5a;
                done = 1;
            } else if (e->state == E_DISK) {
                pthread_mutex_lock(&p->local);
                int fd = seg_fd_locked(p, e->disk_seg, 0);
                uint8_t c;
                if (fd >= 0 && pread(fd, &c, 1, (off_t)(e->disk_off + o)) == 1) {
                    c ^= 0x5a;
                    done = pwrite(fd, &c, 1, (off_t)(e->disk_off + o)) == 1;
                }
                pthread_mutex_unlock(&p->local);
            }
        }
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    return PyBool_FromLong(done);
}

/* Test hook: hold the pool lock for `seconds` (to test timeouts and death while locked). */
static PyObject *Pool_debug_hold_lock(Pool *p, PyObject *args) {
    double secs;
    if (!PyArg_ParseTuple(args, "d", &secs)) return NULL;
    if (enter(p) < 0) Py_RETURN_FALSE;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = pool_lock(p, now_mono() + 5) == ST_OK;
    if (ok) {
        atomic_store(&p->h->debug_holder, (int32_t)getpid());
        usleep((useconds_t)(secs * 1e6));
        atomic_store(&p->h->debug_holder, 0);
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    return PyBool_FromLong(ok);
}

/* Test hook: reserve space for `key` as a put does, then stall `seconds`
 * before the copy (a writer caught mid-put), then finish the put with zeros. */
static PyObject *Pool_debug_stall_put(Pool *p, PyObject *args) {
    PyObject *key;
    unsigned long long size;
    double secs;
    if (!PyArg_ParseTuple(args, "UKd", &key, &size, &secs)) return NULL;
    if (enter(p) < 0) return status_obj(ST_UNAVAILABLE);
    int st = ST_OK;
    Py_ssize_t kl;
    const char *ks = PyUnicode_AsUTF8AndSize(key, &kl);
    uint64_t P = p->h->page_size, need = (size + P - 1) / P;
    Py_BEGIN_ALLOW_THREADS
    st = pool_lock(p, now_mono() + 5);
    uint32_t e = NONE32;
    if (!st) {
        while (p->h->free_pages < need && evict_one(p, 1)) {}
        e = p->h->free_pages >= need ? entry_alloc(p) : NONE32;
        if (e == NONE32) st = ST_NO_SPACE;
        else {
            entry_t *en = &ENT(p)[e];
            en->state = E_RESERVED;
            en->owner = p->slot;
            en->npages = (uint32_t)need;
            en->size = size;
            en->keylen = (uint32_t)kl;
            memcpy(en->key, ks, kl);
            en->hash = key_hash(ks, kl);
            en->first_page = pages_alloc(p, (uint32_t)need);
            en->version = ++p->h->next_version;
            p->h->reserved_pages += (uint32_t)need;
            atomic_store(&p->h->debug_holder, -(int32_t)getpid());
        }
        pool_unlock(p);
    }
    if (!st) {
        usleep((useconds_t)(secs * 1e6));
        if (pool_lock(p, now_mono() + 5) == ST_OK) {
            entry_t *en = &ENT(p)[e];
            if (en->state == E_RESERVED && en->owner == p->slot) reservation_drop(p, e);
            atomic_store(&p->h->debug_holder, 0);
            pool_unlock(p);
        }
    }
    Py_END_ALLOW_THREADS
    leave(p);
    return status_obj(st);
}

static PyObject *Pool_debug_delay(Pool *p, PyObject *args) {
    double secs;
    if (!PyArg_ParseTuple(args, "d", &secs)) return NULL;
    atomic_store(&p->delay_s, secs > 0 ? secs : 0);
    Py_RETURN_NONE;
}

static PyObject *Pool_debug_spill_stall(Pool *p, PyObject *args) {
    double secs;
    if (!PyArg_ParseTuple(args, "d", &secs)) return NULL;
    atomic_store(&p->spill_stall_s, secs > 0 ? secs : 0);
    Py_RETURN_NONE;
}

static PyObject *Pool_debug_scan_stall(Pool *p, PyObject *args) {
    double secs;
    if (!PyArg_ParseTuple(args, "d", &secs)) return NULL;
    atomic_store(&p->scan_stall_s, secs > 0 ? secs : 0);
    Py_RETURN_NONE;
}

static PyObject *Pool_debug_put_stall(Pool *p, PyObject *args) {
    double secs;
    if (!PyArg_ParseTuple(args, "d", &secs)) return NULL;
    atomic_store(&p->put_stall_s, secs > 0 ? secs : 0);
    Py_RETURN_NONE;
}

/* Test hook: the arena pages of each key, in object order ([] when the key is
 * absent or on disk); read under the lock. */
static PyObject *Pool_debug_pages(Pool *p, PyObject *args) {
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "O", &keys)) return NULL;
    batch_t b;
    if (batch_parse(&b, keys, NULL) < 0) return NULL;
    if (enter(p) < 0) {
        batch_free(&b);
        return PyErr_Format(PyExc_RuntimeError, "pool closed");
    }
    uint64_t total = 0;
    int st;
    uint32_t *pages = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = pool_lock(p, now_mono() + 5);
    if (!st) {
        for (Py_ssize_t i = 0; i < b.n; i++) {
            uint32_t e = b.items[i].key ? find(p, b.items[i].key, b.items[i].klen, b.items[i].hash) : NONE32;
            b.items[i].idx = e;
            b.items[i].npages = e != NONE32 && ENT(p)[e].state != E_DISK ? ENT(p)[e].npages : 0;
            total += b.items[i].npages;
        }
        pages = malloc(sizeof(uint32_t) * (total + 1));
        uint64_t o = 0;
        for (Py_ssize_t i = 0; pages && i < b.n; i++) {
            uint32_t pg = b.items[i].npages ? ENT(p)[b.items[i].idx].first_page : NONE32;
            for (uint32_t k = 0; k < b.items[i].npages; k++, pg = NEXT(p)[pg]) pages[o++] = pg;
        }
        pool_unlock(p);
    }
    Py_END_ALLOW_THREADS
    leave(p);
    PyObject *out = NULL;
    if (st) PyErr_Format(PyExc_RuntimeError, "pool lock: status %d", st);
    else if (!pages) PyErr_NoMemory();
    else if ((out = PyList_New(b.n))) {
        uint64_t o = 0;
        for (Py_ssize_t i = 0; i < b.n; i++) {
            PyObject *l = PyList_New(b.items[i].npages);
            if (!l) {
                Py_CLEAR(out);
                break;
            }
            for (uint32_t k = 0; k < b.items[i].npages; k++) PyList_SET_ITEM(l, k, PyLong_FromUnsignedLong(pages[o++]));
            PyList_SET_ITEM(out, i, l);
        }
    }
    free(pages);
    batch_free(&b);
    return out;
}

static PyObject *Pool_debug_holder(Pool *p, PyObject *noargs) {
    if (!p->h || atomic_load(&p->closed)) return PyLong_FromLong(0);
    return PyLong_FromLong(atomic_load(&p->h->debug_holder));
}

static PyObject *Pool_close(Pool *p, PyObject *args) {
    int destroy = 0;
    if (!PyArg_ParseTuple(args, "|p", &destroy)) return NULL;
    if (atomic_exchange(&p->closed, 1)) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    while (atomic_load(&p->busy)) usleep(100);
    if (p->pid == getpid()) pool_detach(p, destroy);
    else { /* inherited from a parent: leave the parent's slot alone */
        p->h = NULL;
        if (p->lock_fd >= 0) close(p->lock_fd); /* the parent keeps its own descriptor */
        p->lock_fd = -1;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Pool_get_shm_name(Pool *p, void *c) { return PyUnicode_FromString(p->shm_name); }
static PyObject *Pool_get_collapsed(Pool *p, void *c) { return PyBool_FromLong(p->collapsed); }
static PyObject *Pool_get_filling(Pool *p, void *c) { return PyBool_FromLong(p->filling && p->pid == getpid()); }
static PyObject *Pool_get_created(Pool *p, void *c) { return PyBool_FromLong(p->created); }
/* The options the pool was made with (its header's; fixed once it is ready). */
static PyObject *Pool_get_made_with(Pool *p, void *c) {
    if (!p->h) Py_RETURN_NONE;
    const hdr_t *h = p->h;
    return Py_BuildValue("{sKsKsIsOszsKsK}", "capacity", (unsigned long long)h->capacity, "page_size",
                         (unsigned long long)h->page_size, "max_keys", h->max_keys, "checksum",
                         h->checksum ? Py_True : Py_False, "disk_path", h->disk_path[0] ? h->disk_path : NULL,
                         "disk_capacity", (unsigned long long)h->disk_capacity, "disk_segment_size",
                         (unsigned long long)h->disk_seg_size);
}
static PyObject *Pool_get_closed(Pool *p, void *c) { return PyBool_FromLong(atomic_load(&p->closed) || !p->h); }

static PyMethodDef Pool_methods[] = {
    {"exists", (PyCFunction)Pool_exists, METH_VARARGS, "exists(keys, timeout_s) -> [Status]"},
    {"put", (PyCFunction)Pool_put, METH_VARARGS, "put(keys, regions, timeout_s) -> [Status]"},
    {"put_absent", (PyCFunction)Pool_put_absent, METH_VARARGS,
     "put_absent(keys, regions, timeout_s) -> ([Status], [index of each key held already: OK, not written])"},
    {"pin", (PyCFunction)Pool_pin, METH_VARARGS, "pin(keys, lease_s, timeout_s) -> [Status]: exists + pin"},
    {"pin_breaks", (PyCFunction)Pool_pin_breaks, METH_NOARGS,
     "pin_breaks() -> int: pinned objects that left the pool other than by a newer value (-1: closed)"},
    {"unpin", (PyCFunction)Pool_unpin, METH_VARARGS, "unpin(keys, timeout_s) -> [Status]"},
    {"pinned", (PyCFunction)Pool_pinned, METH_VARARGS, "pinned(timeout_s) -> (Status, objects pinned now)"},
    {"get", (PyCFunction)Pool_get, METH_VARARGS, "get(keys, regions, timeout_s) -> [Status]"},
    {"remove", (PyCFunction)Pool_remove, METH_VARARGS, "remove(keys, timeout_s) -> [Status]"},
    {"scan", (PyCFunction)Pool_scan, METH_VARARGS,
     "scan(prefix, remove, limit, timeout_s) -> (Status, count | [keys])"},
    {"collapse_release", (PyCFunction)Pool_collapse_release, METH_NOARGS,
     "collapse_release(): give up making 2 MiB pages as the pool fills, for another process to take over"},
    {"collapse_step", (PyCFunction)Pool_collapse_step, METH_VARARGS,
     "collapse_step(n) -> (stretches made 2 MiB pages, cursor bytes, state 0 caught up / 1 done / -1 not here "
     "or refused / 2 closed / 3 another process fills): 2 MiB pages as the pool fills (MADV_COLLAPSE)"},
    {"prefix_run", (PyCFunction)Pool_prefix_run, METH_VARARGS,
     "prefix_run(prefixes, suffixes, gallop, timeout_s, lease_s=0) -> (Status, chunks present from 0, probes);"
     " lease_s > 0 also pins those chunks"},
    {"unpin_run", (PyCFunction)Pool_unpin_run, METH_VARARGS,
     "unpin_run(prefixes, suffixes, timeout_s) -> Status: drop this process's pins of those chunks"},
    {"stats", (PyCFunction)Pool_stats, METH_VARARGS, "stats(timeout_s) -> (Status, dict)"},
    {"removed_since", (PyCFunction)Pool_removed_since, METH_VARARGS,
     "removed_since(cursor, limit, timeout_s) -> (Status, next_cursor, [(seq, key, tier, reason, moved_to)], lost)"},
    {"check", (PyCFunction)Pool_check, METH_VARARGS, "check(timeout_s) -> '' or a description of problems"},
    {"debug_corrupt", (PyCFunction)Pool_debug_corrupt, METH_VARARGS, "flip a byte of a stored object"},
    {"debug_hold_lock", (PyCFunction)Pool_debug_hold_lock, METH_VARARGS, "hold the pool lock for seconds"},
    {"debug_stall_put", (PyCFunction)Pool_debug_stall_put, METH_VARARGS, "reserve a put, then stall"},
    {"debug_spill_stall", (PyCFunction)Pool_debug_spill_stall, METH_VARARGS,
     "pause this handle's spills between their disk writes and finalizing them"},
    {"debug_put_stall", (PyCFunction)Pool_debug_put_stall, METH_VARARGS,
     "pause this handle's puts between reserving and copying in"},
    {"debug_scan_stall", (PyCFunction)Pool_debug_scan_stall, METH_VARARGS,
     "pause this handle's linear prefix scans between their blocks, unlocked"},
    {"debug_delay", (PyCFunction)Pool_debug_delay, METH_VARARGS, "make data calls of this handle slow"},
    {"debug_pages", (PyCFunction)Pool_debug_pages, METH_VARARGS, "arena pages of each key, in order"},
    {"debug_holder", (PyCFunction)Pool_debug_holder, METH_NOARGS, "pid holding a debug hook (neg: stalled put)"},
    {"close", (PyCFunction)Pool_close, METH_VARARGS, "close(destroy=False)"},
    {NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"shm_name", (getter)Pool_get_shm_name, NULL, NULL, NULL},
    {"created", (getter)Pool_get_created, NULL, NULL, "this process created the pool's segment"},
    {"made_with", (getter)Pool_get_made_with, NULL, NULL,
     "the options the pool was made with: capacity, page_size, max_keys, checksum, disk_path, disk_capacity, "
     "disk_segment_size"},
    {"collapsed", (getter)Pool_get_collapsed, NULL, NULL,
     "MADV_COLLAPSE made 2 MiB pages of the arena through this handle (prefault, or as the pool fills)"},
    {"filling", (getter)Pool_get_filling, NULL, NULL,
     "this handle makes the pool's 2 MiB pages as it fills (collapse_step; one live process at a time)"},
    {"closed", (getter)Pool_get_closed, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ascendstore.local._shmpool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Pool_new,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_weaklistoffset = offsetof(Pool, weakreflist),
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
    .tp_doc = "A handle on a shared-memory KV pool (see module docs).",
};

static PyObject *mod_set_status_table(PyObject *m, PyObject *t) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 7) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of the 7 Status members");
        return NULL;
    }
    Py_XDECREF(status_table);
    Py_INCREF(t);
    status_table = t;
    Py_RETURN_NONE;
}

static PyObject *mod_unlink(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    char path[200];
    snprintf(path, sizeof path, "/ascendstore-lock.%s", name);
    shm_unlink(path);
    snprintf(path, sizeof path, "/ascendstore-pool.%s", name);
    return PyBool_FromLong(shm_unlink(path) == 0);
}

/* checksum(data, pieces=(), scalar=False): the object checksum of a bytes-like
 * object fed in pieces of the given lengths (for tests of the streaming form). */
static PyObject *mod_checksum(PyObject *m, PyObject *args) {
    Py_buffer buf;
    PyObject *pieces = NULL;
    int scalar = 0;
    if (!PyArg_ParseTuple(args, "y*|Op", &buf, &pieces, &scalar)) return NULL;
    int saved = ck_have_avx2;
    if (scalar) ck_have_avx2 = 0;
    ck_t c;
    ck_init(&c);
    size_t off = 0;
    if (pieces) {
        PyObject *f = PySequence_Fast(pieces, "pieces must be a sequence of ints");
        if (!f) {
            ck_have_avx2 = saved;
            PyBuffer_Release(&buf);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(f); i++) {
            size_t n = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(f, i));
            if (n > (size_t)buf.len - off) n = (size_t)buf.len - off;
            ck_update(&c, (const uint8_t *)buf.buf + off, n);
            off += n;
        }
        Py_DECREF(f);
    }
    ck_update(&c, (const uint8_t *)buf.buf + off, (size_t)buf.len - off);
    uint64_t h = ck_final(&c);
    ck_have_avx2 = saved;
    PyBuffer_Release(&buf);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(h);
}

/* copy_regions(dst_addrs, src_addrs, size, stream=0) -> None: memcpy(dst[i], src[i], size)
 * for every i in one call without the GIL (stream 1 / 2: the pool's own copy of a put / get,
 * copy_nt; 0: glibc's memcpy, whatever the addresses' alignment). Benchmark baseline only: the same
 * kind of call as a batched put/get (one C call, one memcpy per object). The
 * addresses must be valid for size bytes; nothing is checked. */
static PyObject *mod_copy_regions(PyObject *m, PyObject *args) {
    PyObject *dsts, *srcs;
    unsigned long long size;
    int stream = 0; /* the pool's own copy, for a baseline of the same routine: 1 as a put, 2 as a get */
    if (!PyArg_ParseTuple(args, "OOK|i", &dsts, &srcs, &size, &stream)) return NULL;
    PyObject *df = PySequence_Fast(dsts, "dst_addrs must be a sequence of int");
    if (!df) return NULL;
    PyObject *sf = PySequence_Fast(srcs, "src_addrs must be a sequence of int");
    if (!sf) {
        Py_DECREF(df);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(df);
    uint64_t *a = NULL;
    if (PySequence_Fast_GET_SIZE(sf) != n) {
        PyErr_SetString(PyExc_ValueError, "copy_regions: as many sources as destinations");
        goto out;
    }
    a = malloc(sizeof(uint64_t) * 2 * (n + 1));
    if (!a) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        a[2 * i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(df, i));
        a[2 * i + 1] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(sf, i));
    }
    if (PyErr_Occurred()) goto out;
    Py_BEGIN_ALLOW_THREADS
    uint64_t total = (uint64_t)size * (uint64_t)n;
    int nt = stream && (stream == 1 || total >= nt_get_min) && nt_batch(total);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *d = (uint8_t *)(uintptr_t)a[2 * i];
        const uint8_t *s = (const uint8_t *)(uintptr_t)a[2 * i + 1];
        if (stream) copy_nt(d, s, size, nt);
        else memcpy(d, s, size); /* the baseline: glibc's memcpy as it is */
    }
    nt_fence(nt);
    Py_END_ALLOW_THREADS
out:
    free(a);
    Py_DECREF(df);
    Py_DECREF(sf);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* scatter(src_addr, regions, ok=None): copy consecutive bytes from src_addr
 * into each object's regions (regions[i]: a sequence of Region or (addr,
 * length)); an object whose ok[i] is false is skipped, its bytes too. The copy
 * out of a landing buffer (the engine's bounce for backends whose calls may
 * outlive their deadline): one call per batch with the GIL released, so it
 * does not pay a Python call per region, and streaming stores from the size a
 * get streams from (the blocks are cold, and stores that skip the cache leave
 * it to the backend's next transfer). Bad regions raise ValueError, nothing copied. */
static PyObject *mod_scatter(PyObject *m, PyObject *args) {
    unsigned long long src;
    PyObject *regions, *ok = Py_None;
    if (!PyArg_ParseTuple(args, "KO|O", &src, &regions, &ok)) return NULL;
    PyObject *rf = PySequence_Fast(regions, "regions must be a sequence of region lists");
    if (!rf) return NULL;
    PyObject *of = NULL;
    reg_t *regs = NULL;
    uint8_t *skip = NULL;
    PyObject *res = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(rf), nregs = 0;
    if (ok != Py_None) {
        if (!(of = PySequence_Fast(ok, "ok must be a sequence of bool"))) goto out;
        if (PySequence_Fast_GET_SIZE(of) != n) {
            PyErr_SetString(PyExc_ValueError, "scatter: one ok flag per object");
            goto out;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = PyObject_Length(PySequence_Fast_GET_ITEM(rf, i));
        if (k < 0) goto out;
        nregs += k;
    }
    regs = malloc(sizeof(reg_t) * (nregs + 1));
    skip = malloc((size_t)nregs + 1);
    if (!regs || !skip) {
        PyErr_NoMemory();
        goto out;
    }
    Py_ssize_t r = 0;
    uint64_t copied = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int use = 1;
        if (of) {
            use = PyObject_IsTrue(PySequence_Fast_GET_ITEM(of, i));
            if (use < 0) goto out;
        }
        PyObject *lf = PySequence_Fast(PySequence_Fast_GET_ITEM(rf, i), "regions must be a sequence of region lists");
        if (!lf) goto out;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(lf);
        for (Py_ssize_t j = 0; j < k && r < nregs; j++, r++) {
            if (parse_region(PySequence_Fast_GET_ITEM(lf, j), &regs[r]) < 0) {
                Py_DECREF(lf);
                PyErr_Format(PyExc_ValueError, "scatter: object %zd region %zd is not a Region or (addr, length)", i, j);
                goto out;
            }
            skip[r] = !use;
            if (use) copied += regs[r].len;
        }
        Py_DECREF(lf);
    }
    nregs = r;
    Py_BEGIN_ALLOW_THREADS
    int nt = copied >= nt_get_min && nt_batch(copied);
    const uint8_t *pos = (const uint8_t *)(uintptr_t)src;
    for (Py_ssize_t i = 0; i < nregs; i++) {
        if (!skip[i] && regs[i].len) copy_nt((uint8_t *)(uintptr_t)regs[i].addr, pos, regs[i].len, nt);
        pos += regs[i].len;
    }
    nt_fence(nt);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
out:
    free(regs);
    free(skip);
    Py_XDECREF(of);
    Py_DECREF(rf);
    return res;
}

/* hex_keys(prefixes, hashes) -> list[str]: each prefix + the lowercase hex of each
 * raw hash, chunk-major ([p + h.hex() for h in hashes for p in prefixes]). The
 * keys a lookup asks a backend without a native scan (Mooncake, MemCache) about:
 * in Python each is two new strings (the hex, then the key), 60-72 us for a 128k
 * prompt's 1024; here one string each, its digits by hex_encode (14 us).
 * prefixes: ASCII str; hashes: bytes. Anything else raises TypeError. */
static PyObject *mod_hex_keys(PyObject *m, PyObject *args) {
    PyObject *prefs, *hashes;
    if (!PyArg_ParseTuple(args, "OO", &prefs, &hashes)) return NULL;
    PyObject *pf = PySequence_Fast(prefs, "prefixes must be a sequence of str");
    if (!pf) return NULL;
    PyObject *hf = PySequence_Fast(hashes, "hashes must be a sequence of bytes");
    if (!hf) {
        Py_DECREF(pf);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(pf), n = PySequence_Fast_GET_SIZE(hf);
    for (Py_ssize_t j = 0; j < np; j++) {
        PyObject *p = PySequence_Fast_GET_ITEM(pf, j);
        if (!PyUnicode_Check(p) || !PyUnicode_IS_COMPACT_ASCII(p)) {
            PyErr_SetString(PyExc_TypeError, "hex_keys: prefixes must be ASCII str");
            goto out;
        }
    }
    if (n && np > PY_SSIZE_T_MAX / n) {
        PyErr_NoMemory();
        goto out;
    }
    out = PyList_New(n * np);
    if (!out) goto out;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(hf, i);
        if (!PyBytes_Check(h)) {
            PyErr_SetString(PyExc_TypeError, "hex_keys: hashes must be bytes");
            Py_CLEAR(out);
            goto out;
        }
        Py_ssize_t hl = PyBytes_GET_SIZE(h);
        for (Py_ssize_t j = 0; j < np; j++) {
            PyObject *p = PySequence_Fast_GET_ITEM(pf, j);
            Py_ssize_t pl = PyUnicode_GET_LENGTH(p);
            PyObject *k = PyUnicode_New(pl + 2 * hl, 127); /* compact ASCII, one byte a char */
            if (!k) {
                Py_CLEAR(out);
                goto out;
            }
            char *d = (char *)PyUnicode_DATA(k);
            memcpy(d, PyUnicode_DATA(p), (size_t)pl);
            hex_encode(d + pl, (const uint8_t *)PyBytes_AS_STRING(h), (size_t)hl);
            PyList_SET_ITEM(out, i * np + j, k);
        }
    }
out:
    Py_DECREF(pf);
    Py_DECREF(hf);
    return out;
}

/* keys_fit(keys, max_len) -> bool: every key a non-empty ASCII str of at most
 * max_len characters (so as many bytes). A backend's check of a batch before it
 * sends it (ascendstore.contract.keys_fit): a flag and a length read per key, where
 * Python's C-level passes (a join of every key, then a set of their lengths) took
 * ~19 us for a 128k prompt's 1024 keys. Not a str: False (the caller looks closer). */
static PyObject *mod_keys_fit(PyObject *m, PyObject *args) {
    PyObject *keys;
    Py_ssize_t max_len;
    if (!PyArg_ParseTuple(args, "On", &keys, &max_len)) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence of str");
    if (!kf) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    PyObject **items = PySequence_Fast_ITEMS(kf);
    int fit = 1;
    for (Py_ssize_t i = 0; i < n && fit; i++) {
        PyObject *k = items[i];
        /* (an ASCII str made by the legacy API is not compact: judged unfit, looked at closer) */
        fit = PyUnicode_Check(k) && PyUnicode_IS_COMPACT_ASCII(k) && PyUnicode_GET_LENGTH(k) > 0 &&
              PyUnicode_GET_LENGTH(k) <= max_len;
    }
    Py_DECREF(kf);
    return PyBool_FromLong(fit);
}

/* stream_min(put_bytes=-1, get_bytes=-1) -> (put, get): batch sizes from which
 * puts / gets copy with streaming stores; a negative argument keeps the value.
 * For tests (force the streaming path on small data) and benchmarks. */
static PyObject *mod_stream_min(PyObject *m, PyObject *args) {
    long long put = -1, get = -1;
    if (!PyArg_ParseTuple(args, "|LL", &put, &get)) return NULL;
    if (put >= 0) nt_put_min = (uint64_t)put;
    if (get >= 0) nt_get_min = (uint64_t)get;
    return Py_BuildValue("(KK)", (unsigned long long)nt_put_min, (unsigned long long)nt_get_min);
}

static PyObject *mod_entry_size(PyObject *m, PyObject *noargs) { return PyLong_FromSize_t(sizeof(entry_t)); }

static PyMethodDef mod_methods[] = {
    {"set_status_table", mod_set_status_table, METH_O, "results become these objects (index = code)"},
    {"unlink", mod_unlink, METH_O, "remove a pool's shared-memory name (by pool name)"},
    {"checksum", mod_checksum, METH_VARARGS, "checksum(data, pieces=(), scalar=False) -> int"},
    {"stream_min", mod_stream_min, METH_VARARGS, "stream_min(put_bytes=-1, get_bytes=-1) -> (put, get): streaming-copy thresholds"},
    {"copy_regions", mod_copy_regions, METH_VARARGS, "copy_regions(dsts, srcs, size, stream=0): benchmark memcpy baseline (1/2: the pool's put/get copy)"},
    {"scatter", mod_scatter, METH_VARARGS, "scatter(src_addr, regions, ok=None): copy consecutive bytes out to each object's regions"},
    {"hex_keys", mod_hex_keys, METH_VARARGS, "hex_keys(prefixes, hashes) -> [p + h.hex() for h in hashes for p in prefixes]"},
    {"keys_fit", mod_keys_fit, METH_VARARGS, "keys_fit(keys, max_len) -> every key a non-empty ASCII str of at most max_len"},
    {"entry_size", mod_entry_size, METH_NOARGS, "bytes of metadata per key slot"},
    {NULL},
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_shmpool",
                                 "Shared-memory KV pool core of the AscendStore local backend.", -1, mod_methods};

PyMODINIT_FUNC PyInit__shmpool(void) {
    ck_setup();
    nt_setup();
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    if (PyType_Ready(&PoolType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&PoolType);
    PyModule_AddObject(m, "Pool", (PyObject *)&PoolType);
    PyModule_AddIntConstant(m, "MAX_KEY_BYTES", MAX_KEY);
    PyModule_AddIntConstant(m, "MAX_PROCESSES", MAX_PROCS);
    return m;
}
