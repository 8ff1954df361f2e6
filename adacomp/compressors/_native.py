"""Fused CPU passes in C, compiled on first use: threshold selection over magnitudes in one read.

Why: on CPU, torch's comparison into a bool mask and the ``nonzero`` after it cost ~0.9 ns per
element together (measured: 1.0 ms + 1.1 ms on a 2.4M-element tensor, against 0.12 ms for an
``abs`` pass), so every threshold sparsifier (Top-k's prefilter, Gaussian-k, RedSync, DGC,
MSTop-k, SIDCo, OkTopk) spent most of its time building masks. One C loop reads the magnitudes
once, tests 16 at a time (64 with AVX2) and writes only the passing indices and
values: the same elements, in the same ascending order, as ``nonzero`` of torch's comparison.

Exactness: the threshold is rounded to float32 once, as torch does when it compares a float32
tensor with a Python number; comparisons are IEEE (no ``-ffast-math``: NaN fails ``>=`` and ``>``
and passes ``not <``). Results are therefore bitwise those of the torch path, which stays in use
where the library cannot be built (no C compiler) or ``ADACOMP_NATIVE=0`` is set.

The library is built with the system C compiler (``CC``, default ``cc``) into
``$ADACOMP_CACHE`` (default ``~/.cache/adacomp``)/native, named by a hash of source and flags; it
needs no torch headers, so a build takes well under a second. Ranks building at once each write
a private file and rename it into place.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors.workspace import Workspace

STREAM_MIN = 1 << 16
"""``AC_STREAM_MIN``: outputs from this many elements are written with non-temporal stores."""

MODES = {"ge": 0, "gt": 1, "not_lt": 2}
"""``a >= t``, ``a > t``, ``not (a < t)`` (NaN passes only the last, as torch.topk ranks NaN first);
each also as ``abs_<mode>``: the test on ``|a|`` (sign bit cleared, as torch.abs does), values ``|a|``."""

_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
/* Loops the compiler vectorises are also built for AVX2 and picked at load time where the CPU has
   it (8 floats per instruction instead of SSE2's 4). The same IEEE operation per element, no
   contraction into FMA (-ffp-contract=off): the bits do not depend on the clone that runs. */
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 6) \
    && defined(__linux__)
#define AC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AC_CLONES
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
/* The hand-written AVX2 loops run where the CPU has AVX2 unless ac_avx2_off is set (tests run both
   ways and compare the bits). */
int ac_avx2_off = 0;
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AC_AVX2 1
static int use_avx2(void) { return !ac_avx2_off && __builtin_cpu_supports("avx2"); }
#endif
#if defined(AC_AVX2)
/* ac_compact_lanes[mask]: the lanes set in an 8-bit mask, in order, one byte each (the permutation of
   a vector compaction); ac_compact_pairs[mask]: the same for a 4-bit mask over 64-bit lanes, as pairs
   of 32-bit lanes. */
static uint64_t ac_compact_lanes[256], ac_compact_pairs[16];
__attribute__((constructor)) static void ac_compact_lanes_init(void) {
    for (int mask = 0; mask < 256; ++mask) {
        uint64_t lanes = 0, pairs = 0;
        int w = 0;
        for (int i = 0; i < 8; ++i)
            if (mask >> i & 1) {
                lanes |= (uint64_t)i << (8 * w);
                if (i < 4) pairs |= ((uint64_t)(2 * i) | (uint64_t)(2 * i + 1) << 8) << (16 * w);
                ++w;
            }
        ac_compact_lanes[mask] = lanes;
        if (mask < 16) ac_compact_pairs[mask] = pairs;
    }
}
static inline __attribute__((target("avx2"))) __m256i compact_perm(const uint64_t* table, unsigned mask) {
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)table[mask]));
}
#endif
/* Outputs of at least AC_STREAM_MIN elements are written with non-temporal stores where the CPU has
   AVX2: their lines are not read first (a plain store to a line not in cache reads it), a third of
   the traffic of a pass that reads two tensors and writes one. The same floats. Such a tensor is
   read back from memory anyway (past what the caches hold). From 2^16 (2^20 before): PowerSGD's
   cost cells, alternating, ResNet-50 39.6 / 39.7 -> 36.5 / 35.4 ms, GPT-2-small 144 / 128 ->
   121 / 122 ms; EF-SignSGD, DGC, RedSync, Gaussian-k within noise on ResNet-50. */
#define AC_STREAM_MIN (1 << 16)
/* The cascade's sum (EF-SignSGD's, Gaussian-k's compensation) streams from 2^20 elements only:
   Gaussian-k reads it straight back, from the caches up to there (GPT-2-small's Gaussian-k cost cell
   was 2-3 % slower with it streamed from 2^16, while the other passes' outputs gained). */
#define AC_CASCADE_STREAM_MIN (1 << 20)
/* The fused passes' inputs are prefetched AC_AHEAD_BYTES ahead of the element being read, LINES cache
   lines of 64 bytes from there (a 64-element block of floats: 4 lines). The hardware's stream
   prefetcher does not run ahead across 4 KiB pages, and a pass that selects, sums or emits between
   its loads leaves it time it does not use: on the Xeon, over the zoo models' tensors of >= 2^16
   elements, the selecting passes took 4-20 % less with it (2048, 4096 and 8192 bytes alike) and bf16's
   cast 24-28 %; the plain streamed add, DGC's momentum pass, the cascade sum, QSGD's coding, the
   bf16 widening and the low-rank passes gained nothing (the last two lost 3-12 % with prefetches of
   their 8 and 16 input streams), so those go without (cost_notes item 55; `adacomp bench cost passes`
   times each pass against another version's library).
   A prefetch never faults: the address past an array's end is formed as an integer and never read. */
#define AC_AHEAD_BYTES 4096
#define AC_AHEAD(P, I, LINES)                                                           \
    do {                                                                                \
        for (int l_ = 0; l_ < (LINES); ++l_)                                            \
            __builtin_prefetch((const void*)((uintptr_t)((P) + (I)) + AC_AHEAD_BYTES + 64u * l_)); \
    } while (0)
/* The 16-element test per block is one bit mask (SSE compares where the target has them), so a
   block with no passing element costs no branch per element; passing ones are read off the mask
   in ascending order. NaN: ordered compares fail, so v >= t and v > t are false and !(v < t) true. */
#if defined(__SSE2__)
#define MASK16(CMP, LOAD)                                                               \
    (_mm_movemask_ps(CMP(LOAD(a + i), tv))                                              \
     | (_mm_movemask_ps(CMP(LOAD(a + i + 4), tv)) << 4)                                 \
     | (_mm_movemask_ps(CMP(LOAD(a + i + 8), tv)) << 8)                                 \
     | (_mm_movemask_ps(CMP(LOAD(a + i + 12), tv)) << 12))
#define CMP_GE(x, y) _mm_cmpge_ps(x, y)
#define CMP_GT(x, y) _mm_cmpgt_ps(x, y)
#define CMP_NOT_LT(x, y) _mm_cmpnlt_ps(x, y)
#define LOAD_AS_IS(p) _mm_loadu_ps(p)
#define LOAD_ABS(p) _mm_andnot_ps(_mm_set1_ps(-0.0f), _mm_loadu_ps(p))
/* The passing elements of one mask M (bit j: element AT + j), in ascending order, into idx / vals
   (VALUE: what is written, j in scope) while c < cap; c counts them all. */
#define AC_EMIT(M, CTZ, AT, VALUE)                                                      \
    while (M) {                                                                         \
        const int j = CTZ(M);                                                           \
        M &= M - 1;                                                                     \
        if (c < cap) { idx[c] = (AT) + j; vals[c] = (VALUE); }                          \
        ++c;                                                                            \
    }
/* AC_EMIT for a 64-element block (VALUE readable at every j < 64): the first two passing elements are
   written without a branch (where fewer pass, the block's last element is written past the count and
   later overwritten or never read), so the loop, whose exit the branch predictor misses, runs only
   for blocks with more than two. The same elements, order and count as AC_EMIT. */
#define AC_EMIT64(M, AT, VALUE)                                                         \
    if (c + 2 <= cap) {                                                                 \
        for (int u_ = 0; u_ < 2; ++u_) {                                                \
            const int j = __builtin_ctzll((M) | (1ULL << 63));                          \
            idx[c] = (AT) + j;                                                          \
            vals[c] = (VALUE);                                                          \
            c += (M) != 0;                                                              \
            M &= M - 1;                                                                 \
        }                                                                               \
    }                                                                                   \
    AC_EMIT(M, __builtin_ctzll, AT, VALUE)
#if defined(AC_AVX2)
/* A 64-element block with many passing elements (a threshold's first stage keeps ~20 %): its values
   (at P, |P| where ABS) and positions (AT + lane) packed eight lanes at a time by the compaction
   tables, without a branch per element (the loop above runs ~14 times a block there, and its exit
   is mispredicted). Writes up to 8 slots past the count, so only where 64 more fit under cap; the
   same elements, order and count as AC_EMIT64. */
#define AC_DENSE_MIN 8
__attribute__((target("avx2"), always_inline)) static inline int64_t ac_pack64(uint64_t m, int64_t at, const float* p,
                                                                           const int absv, int64_t* idx, float* vals) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t c = 0;
    for (int q = 0; q < 8; ++q) {
        const unsigned b = (unsigned)(m >> (8 * q)) & 0xffu;
        const __m256i perm = compact_perm(ac_compact_lanes, b);
        __m256 v = _mm256_loadu_ps(p + 8 * q);
        if (absv) v = _mm256_andnot_ps(sign, v);
        _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(v, perm));
        const __m256i on = _mm256_permutevar8x32_epi32(lane, perm);
        const __m256i base = _mm256_set1_epi64x(at + 8 * q);
        _mm256_storeu_si256((__m256i*)(idx + c), _mm256_add_epi64(base, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(on))));
        _mm256_storeu_si256((__m256i*)(idx + c + 4),
                            _mm256_add_epi64(base, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(on, 1))));
        c += __builtin_popcount(b);
    }
    return c;
}
/* AC_EMIT64 where the block's values lie at P (|P| where ABS), inside an AVX2 function: packed where dense */
#define AC_EMIT64P(M, AT, P, ABS, VALUE)                                                \
    if (c + 64 <= cap && __builtin_popcountll(M) >= AC_DENSE_MIN) {                     \
        c += ac_pack64(M, AT, P, ABS, idx + c, vals + c);                              \
    } else {                                                                            \
        AC_EMIT64(M, AT, VALUE)                                                         \
    }
#endif
/* With AVX2 the mask covers 64 elements (eight 8-lane compares): at the densities a threshold
   search keeps (a few percent) most blocks pass nothing, so the loop over a block's passing
   elements, whose exit the branch predictor misses, runs once per 64 elements instead of per 16.
   The same elements in the same order as the loop below. */
#if defined(AC_AVX2)
#define CMP_GE_8(x, y) _mm256_cmp_ps(x, y, _CMP_GE_OQ)
#define CMP_GT_8(x, y) _mm256_cmp_ps(x, y, _CMP_GT_OQ)
#define CMP_NOT_LT_8(x, y) _mm256_cmp_ps(x, y, _CMP_NLT_UQ)
#define LOAD_AS_IS_8(p) _mm256_loadu_ps(p)
#define LOAD_ABS_8(p) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(p))
#define AS_IS(x) (x)
/* AC_EMIT64P's ABS for a SELECT's VAL */
#define AC_ABS_AS_IS 0
#define AC_ABS___builtin_fabsf 1
#define SELECT_AVX2(NAME, CMP8, LOAD8, VAL)                                             \
__attribute__((target("avx2"))) static int64_t NAME##_avx2(const float* a, int64_t n, float t, int64_t* idx, \
                                                          float* vals, int64_t cap, int64_t* count) { \
    int64_t c = 0, i = 0;                                                               \
    const __m256 tv = _mm256_set1_ps(t);                                                \
    for (; i + 64 <= n; i += 64) {                                                      \
        uint64_t m = 0;                                                                 \
        AC_AHEAD(a, i, 4);                                                              \
        for (int q = 0; q < 8; ++q)                                                     \
            m |= (uint64_t)(unsigned)_mm256_movemask_ps(CMP8(LOAD8(a + i + 8 * q), tv)) << (8 * q); \
        AC_EMIT64P(m, i, a + i, AC_ABS_##VAL, VAL(a[i + j]))                            \
    }                                                                                   \
    *count = c;                                                                         \
    return i;                                                                           \
}
#define AVX2_FIRST(STMT) if (use_avx2()) { STMT; }
#else
#define SELECT_AVX2(NAME, CMP8, LOAD8, VAL)
#define AVX2_FIRST(STMT)
#endif
/* VAL: the value tested and written (the element itself, or |element| with the sign bit cleared as
   torch.abs does: a Top-k prefilter on the signed gradient without a magnitudes pass). */
#define SELECT_T(NAME, PASS, CMP, LOAD, VAL)                                            \
SELECT_AVX2(NAME, CMP##_8, LOAD##_8, VAL)                                               \
int64_t NAME(const float* a, int64_t n, float t, int64_t* idx, float* vals, int64_t cap) { \
    int64_t c = 0, i = 0;                                                               \
    __m128 tv = _mm_set1_ps(t);                                                         \
    AVX2_FIRST(i = NAME##_avx2(a, n, t, idx, vals, cap, &c))                            \
    for (; i + 16 <= n; i += 16) {                                                      \
        unsigned m = (unsigned)MASK16(CMP, LOAD);                                       \
        AC_EMIT(m, __builtin_ctz, i, VAL(a[i + j]))                                     \
    }                                                                                   \
    for (; i < n; ++i) {                                                                \
        float v = VAL(a[i]);                                                            \
        if (PASS) { if (c < cap) { idx[c] = i; vals[c] = v; } ++c; }                    \
    }                                                                                   \
    return c;                                                                           \
}
#else
#define SELECT_T(NAME, PASS, CMP, LOAD, VAL)                                            \
int64_t NAME(const float* a, int64_t n, float t, int64_t* idx, float* vals, int64_t cap) { \
    int64_t c = 0;                                                                      \
    for (int64_t i = 0; i < n; ++i) {                                                   \
        float v = VAL(a[i]);                                                            \
        if (PASS) { if (c < cap) { idx[c] = i; vals[c] = v; } ++c; }                    \
    }                                                                                   \
    return c;                                                                           \
}
#endif
/* A threshold search's last step on the candidates it kept (positions cidx[], signed values a[], n of
   them): those whose |a| passes t (> where strict, else >=; a NaN passes neither), their positions and
   signed values in order, at most cap written, all counted. One pass instead of a selection over the
   kept values and two gathers by its result (cost_notes item 42). */
#if defined(AC_AVX2)
/* ac_pack64 for a block of candidates: positions cidx[0..63] and values a[0..63] of the passing ones */
__attribute__((target("avx2"), always_inline)) static inline int64_t ac_pack_pairs64(uint64_t m, const int64_t* cidx,
                                                                                 const float* a, int64_t* idx,
                                                                                 float* vals) {
    int64_t c = 0;
    for (int q = 0; q < 8; ++q) {
        const unsigned b = (unsigned)(m >> (8 * q)) & 0xffu, lo = b & 15u;
        _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(_mm256_loadu_ps(a + 8 * q), compact_perm(ac_compact_lanes, b)));
        const __m256i x = _mm256_loadu_si256((const __m256i*)(cidx + 8 * q));
        const __m256i y = _mm256_loadu_si256((const __m256i*)(cidx + 8 * q + 4));
        _mm256_storeu_si256((__m256i*)(idx + c), _mm256_permutevar8x32_epi32(x, compact_perm(ac_compact_pairs, lo)));
        _mm256_storeu_si256((__m256i*)(idx + c + __builtin_popcount(lo)),
                            _mm256_permutevar8x32_epi32(y, compact_perm(ac_compact_pairs, b >> 4)));
        c += __builtin_popcount(b);
    }
    return c;
}
/* ac_pack_pairs64 for int32 candidate positions (ac_select_abs_gt_signed32's), written as int64 */
__attribute__((target("avx2"), always_inline)) static inline int64_t ac_pack_pairs64_i32(uint64_t m,
                                                                                     const int32_t* cidx,
                                                                                     const float* a, int64_t* idx,
                                                                                     float* vals) {
    int64_t c = 0;
    for (int q = 0; q < 8; ++q) {
        const unsigned b = (unsigned)(m >> (8 * q)) & 0xffu;
        const __m256i perm = compact_perm(ac_compact_lanes, b);
        _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(_mm256_loadu_ps(a + 8 * q), perm));
        const __m256i x = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(cidx + 8 * q)), perm);
        _mm256_storeu_si256((__m256i*)(idx + c), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(x)));
        _mm256_storeu_si256((__m256i*)(idx + c + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(x, 1)));
        c += __builtin_popcount(b);
    }
    return c;
}
#define PICK_PAIRS_AVX2(NAME, IDX_T, PACK)                                              \
__attribute__((target("avx2"))) static int64_t NAME##_avx2(const float* a, const IDX_T* cidx, int64_t n, float t, \
                                                          int strict, int64_t* idx, float* vals, int64_t cap, \
                                                          int64_t* count) {             \
    const __m256 tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f);                 \
    int64_t c = 0, i = 0;                                                               \
    for (; i + 64 <= n; i += 64) {                                                      \
        uint64_t m = 0;                                                                 \
        for (int q = 0; q < 8; ++q) {                                                   \
            const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(a + i + 8 * q));    \
            const __m256 p = strict ? _mm256_cmp_ps(v, tv, _CMP_GT_OQ) : _mm256_cmp_ps(v, tv, _CMP_GE_OQ); \
            m |= (uint64_t)(unsigned)_mm256_movemask_ps(p) << (8 * q);                  \
        }                                                                               \
        if (c + 64 <= cap && __builtin_popcountll(m) >= AC_DENSE_MIN) {                 \
            c += PACK(m, cidx + i, a + i, idx + c, vals + c);                           \
            continue;                                                                   \
        }                                                                               \
        while (m) {                                                                     \
            const int j = __builtin_ctzll(m);                                           \
            m &= m - 1;                                                                 \
            if (c < cap) { idx[c] = cidx[i + j]; vals[c] = a[i + j]; }                  \
            ++c;                                                                        \
        }                                                                               \
    }                                                                                   \
    *count = c;                                                                         \
    return i;                                                                           \
}
#else
#define PICK_PAIRS_AVX2(NAME, IDX_T, PACK)
#endif
/* IDX_T: the candidates' positions, int64, or int32 (ac_pick_pairs32: SIDCo's first stage keeps them
   so, 8 bytes a kept element written instead of 12); the positions written are int64 either way */
#define PICK_PAIRS(NAME, IDX_T, PACK)                                                   \
PICK_PAIRS_AVX2(NAME, IDX_T, PACK)                                                      \
int64_t NAME(const float* a, const IDX_T* cidx, int64_t n, float t, int strict, int64_t* idx, float* vals, \
             int64_t cap) {                                                             \
    int64_t c = 0, i = 0;                                                               \
    AVX2_FIRST(i = NAME##_avx2(a, cidx, n, t, strict, idx, vals, cap, &c))              \
    for (; i < n; ++i) {                                                                \
        const float v = __builtin_fabsf(a[i]);                                          \
        if (strict ? v > t : v >= t) { if (c < cap) { idx[c] = cidx[i]; vals[c] = a[i]; } ++c; } \
    }                                                                                   \
    return c;                                                                           \
}
PICK_PAIRS(ac_pick_pairs, int64_t, ac_pack_pairs64)
PICK_PAIRS(ac_pick_pairs32, int32_t, ac_pack_pairs64_i32)
/* A threshold's first stage with its positions as int32 (tensors under 2^31 elements): 8 bytes a kept
   element written instead of 12. SIDCo's first stage keeps ~22 % of the tensor (density 0.01, three
   stages), and its later stages read only the values; the final pick widens the positions it takes
   (ac_pick_pairs32). The set, order and count of ac_select_abs_gt_signed. */
#if defined(AC_AVX2)
__attribute__((target("avx2"), always_inline)) static inline int64_t ac_pack64_i32(uint64_t m, int64_t at,
                                                                               const float* p, int32_t* idx,
                                                                               float* vals) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t c = 0;
    for (int q = 0; q < 8; ++q) {
        const unsigned b = (unsigned)(m >> (8 * q)) & 0xffu;
        const __m256i perm = compact_perm(ac_compact_lanes, b);
        _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(_mm256_loadu_ps(p + 8 * q), perm));
        _mm256_storeu_si256((__m256i*)(idx + c), _mm256_add_epi32(_mm256_set1_epi32((int32_t)(at + 8 * q)),
                                                                  _mm256_permutevar8x32_epi32(lane, perm)));
        c += __builtin_popcount(b);
    }
    return c;
}
__attribute__((target("avx2"))) static int64_t select32_avx2(const float* a, int64_t n, float t, int32_t* idx,
                                                            float* vals, int64_t cap, int64_t* count) {
    const __m256 tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f);
    int64_t c = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t m = 0;
        AC_AHEAD(a, i, 4);
        for (int q = 0; q < 8; ++q)
            m |= (uint64_t)(unsigned)_mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(a + i + 8 * q)), tv, _CMP_GT_OQ)) << (8 * q);
        if (c + 64 <= cap && __builtin_popcountll(m) >= AC_DENSE_MIN) {
            c += ac_pack64_i32(m, i, a + i, idx + c, vals + c);
            continue;
        }
        AC_EMIT(m, __builtin_ctzll, (int32_t)i, a[i + j])
    }
    *count = c;
    return i;
}
#endif
int64_t ac_select_abs_gt_signed32(const float* a, int64_t n, float t, int32_t* idx, float* vals, int64_t cap) {
    int64_t c = 0, i = 0;
#if defined(AC_AVX2)
    if (use_avx2()) i = select32_avx2(a, n, t, idx, vals, cap, &c);
#endif
    for (; i < n; ++i)
        if (__builtin_fabsf(a[i]) > t) { if (c < cap) { idx[c] = (int32_t)i; vals[c] = a[i]; } ++c; }
    return c;
}
#define SELECT(NAME, PASS, CMP) SELECT_T(NAME, PASS, CMP, LOAD_AS_IS, AS_IS)
SELECT_T(ac_select_abs_ge, v >= t, CMP_GE, LOAD_ABS, __builtin_fabsf)
SELECT_T(ac_select_abs_gt, v > t, CMP_GT, LOAD_ABS, __builtin_fabsf)
SELECT_T(ac_select_abs_not_lt, !(v < t), CMP_NOT_LT, LOAD_ABS, __builtin_fabsf)
/* The same sets on |a| with the signed values written: a fused compensation's candidates taken
   again from the sum it wrote, where its compaction overflowed (see _compacted's retry) */
SELECT_T(ac_select_abs_ge_signed, __builtin_fabsf(v) >= t, CMP_GE, LOAD_ABS, AS_IS)
SELECT_T(ac_select_abs_gt_signed, __builtin_fabsf(v) > t, CMP_GT, LOAD_ABS, AS_IS)
SELECT_T(ac_select_abs_not_lt_signed, !(__builtin_fabsf(v) < t), CMP_NOT_LT, LOAD_ABS, AS_IS)
SELECT(ac_select_ge, v >= t, CMP_GE)
SELECT(ac_select_gt, v > t, CMP_GT)
SELECT(ac_select_not_lt, !(v < t), CMP_NOT_LT)
/* The bits of the zeroed positions zi[*zj...] (ascending) that fall in the 64-element block at i,
   *zj moved past them. A block holds one or two of them at a sparsifier's density, in no pattern a
   branch predictor learns: the first two are taken without branches, more in a rarely entered loop
   (a loop over each block's positions mispredicted about once a block: ~10 ms of SIDCo's VGG-16 step). */
static inline uint64_t ac_zero_bits(const int64_t* zi, int64_t zm, int64_t* zj, int64_t i) {
    int64_t j = *zj;
    uint64_t bits = 0;
    for (int t = 0; t < 2; ++t) {
        const int more = j < zm;
        const int64_t p = zi[more ? j : zm - 1];
        const uint64_t in = (uint64_t)(more & (p < i + 64));
        bits |= in << ((uint64_t)(p - i) & 63);
        j += (int64_t)in;
    }
    while (j < zm && zi[j] < i + 64) { bits |= (uint64_t)1 << (zi[j] - i); ++j; }
    *zj = j;
    return bits;
}
#if defined(AC_AVX2)
/* the lanes whose bit is set in the low 8 bits, as an all-ones mask */
__attribute__((target("avx2"))) static inline __m256 lanes_of(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit));
}
#endif
/* Error feedback's compensation and Top-k's prefilter in one pass: out = g + r (one IEEE add per
   element, as torch.add), and the indices / signed values of the sums passing !(|sum| < t) (a NaN
   passes), ascending: the set ac_select_abs_not_lt finds over out afterwards, one read less. The
   values keep their signs, so the payload's values need no gather from out (ac_pick_largest). */
#if defined(AC_AVX2)
/* Large tensors with AVX2: 64 sums a block, streamed to out (32-byte aligned; see AC_STREAM_MIN), the
   passing ones read back from the block's copy on the stack. */
/* V = the q-th 8 sums g + r of the 64-element block at i, written to out (streamed where stream) and
   to the block's stack copy blk */
#define AC_SUM8(V)                                                                      \
    const __m256 V = _mm256_add_ps(_mm256_loadu_ps(g + i + 8 * q), _mm256_loadu_ps(r + i + 8 * q)); \
    if (stream) _mm256_stream_ps(out + i + 8 * q, V); else _mm256_storeu_ps(out + i + 8 * q, V); \
    _mm256_store_ps(blk + 8 * q, V)
__attribute__((target("avx2"), always_inline)) static inline int64_t add_select_avx2(
        const float* g, const float* r, float* out, int64_t n, float t, int64_t* idx, float* vals, int64_t cap,
        int64_t* count, const int stream, const int64_t* zi, int64_t zm, int64_t* zj) {
    const __m256 tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f);
    float blk[64] __attribute__((aligned(32)));
    int64_t c = *count, i = 0, j0 = *zj;
    for (; i + 64 <= n; i += 64) {
        uint64_t m = 0;
        const uint64_t zero = zm > 0 ? ac_zero_bits(zi, zm, &j0, i) : 0;
        AC_AHEAD(g, i, 4);
        AC_AHEAD(r, i, 4);
        for (int q = 0; q < 8; ++q) {
            __m256 rv = _mm256_loadu_ps(r + i + 8 * q);
            if (zm > 0)  /* a zeroed position's +0.0 (ac_zero_bits) */
                rv = _mm256_andnot_ps(lanes_of((unsigned)(zero >> (8 * q)) & 0xffu), rv);
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i + 8 * q), rv);
            if (stream) _mm256_stream_ps(out + i + 8 * q, v); else _mm256_storeu_ps(out + i + 8 * q, v);
            _mm256_store_ps(blk + 8 * q, v);
            m |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), tv, _CMP_NLT_UQ))
                 << (8 * q);
        }
        AC_EMIT64P(m, i, blk, 0, blk[j])
    }
    if (stream) _mm_sfence();
    *count = c;
    *zj = j0;
    return i;
}
__attribute__((target("avx2"))) static int64_t add_select_stream(const float* g, const float* r, float* out,
                                                                 int64_t n, float t, int64_t* idx, float* vals,
                                                                 int64_t cap, int64_t* count, const int64_t* zi,
                                                                 int64_t zm, int64_t* zj) {
    return add_select_avx2(g, r, out, n, t, idx, vals, cap, count, 1, zi, zm, zj);
}
__attribute__((target("avx2"))) static int64_t add_select_store(const float* g, const float* r, float* out,
                                                                int64_t n, float t, int64_t* idx, float* vals,
                                                                int64_t cap, int64_t* count, const int64_t* zi,
                                                                int64_t zm, int64_t* zj) {
    return add_select_avx2(g, r, out, n, t, idx, vals, cap, count, 0, zi, zm, zj);
}
#endif
/* out = g + r (one IEEE add per element, as torch.add) into a buffer of its own: error feedback's
   compensation where the compressor reads the sum afterwards; streamed from AC_STREAM_MIN elements. */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t add_stream(const float* g, const float* r, float* out, int64_t n,
                                                          int subtract) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i), y = _mm256_loadu_ps(r + i);
        _mm256_stream_ps(out + i, subtract ? _mm256_sub_ps(x, y) : _mm256_add_ps(x, y));
    }
    _mm_sfence();
    return i;
}
#endif
AC_CLONES void ac_add(const float* g, const float* r, float* out, int64_t n) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0 && use_avx2()) i = add_stream(g, r, out, n, 0);
#endif
    for (; i < n; ++i) out[i] = g[i] + r[i];
}
/* out = a - b (one IEEE subtraction, as torch.sub): error feedback's residual of a compressor that
   decompresses, into the buffer the next step reads; streamed from AC_STREAM_MIN elements. */
AC_CLONES void ac_sub(const float* a, const float* b, float* out, int64_t n) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0 && use_avx2()) i = add_stream(a, b, out, n, 1);
#endif
    for (; i < n; ++i) out[i] = a[i] - b[i];
}
/* The compensation with selection streams from 2^16 elements (not AC_STREAM_MIN): its sums are read
   back only at the few passing positions, and the next step reads the tensor from memory anyway. A/B on
   ResNet-50's Top-k cost cell (alternating runs): 22.4, 22.7, 22.4 ms at 2^16 against 23.8, 23.4, 25.2 ms
   at 2^20; VGG-16 73.7, 75.8 against 77.4, 76.7 ms. */
#define AC_SELECT_STREAM_MIN (1 << 16)
int64_t ac_add_select_abs_not_lt(const float* g, const float* r, float* out, int64_t n, float t,
                                 int64_t* idx, float* vals, int64_t cap, const int64_t* zi, int64_t zm) {
    int64_t c = 0, i = 0, j = 0;
#if defined(AC_AVX2)
    if (n >= AC_SELECT_STREAM_MIN && ((uintptr_t)out & 31) == 0 && use_avx2())
        i = add_select_stream(g, r, out, n, t, idx, vals, cap, &c, zi, zm, &j);
    else if (n >= 64 && use_avx2())
        i = add_select_store(g, r, out, n, t, idx, vals, cap, &c, zi, zm, &j);
#endif
#if defined(__SSE2__)
    const __m128 tv = _mm_set1_ps(t), sign = _mm_set1_ps(-0.0f);
    for (; zm == 0 && i + 16 <= n; i += 16) {  /* zeroed positions: the loop below */
        unsigned m = 0;
        for (int q = 0; q < 4; ++q) {
            const __m128 v = _mm_add_ps(_mm_loadu_ps(g + i + 4 * q), _mm_loadu_ps(r + i + 4 * q));
            _mm_storeu_ps(out + i + 4 * q, v);
            m |= (unsigned)_mm_movemask_ps(_mm_cmpnlt_ps(_mm_andnot_ps(sign, v), tv)) << (4 * q);
        }
        AC_EMIT(m, __builtin_ctz, i, out[i + j])
    }
#endif
    for (; i < n; ++i) {
        const int zeroed = j < zm && zi[j] == i;
        j += zeroed;
        const float v = g[i] + (zeroed ? 0.0f : r[i]);
        out[i] = v;
        if (!(__builtin_fabsf(v) < t)) { if (c < cap) { idx[c] = i; vals[c] = v; } ++c; }
    }
    return c;
}
/* Ok-Topk's compensation of a fusion bucket read from its pieces (gs[s], lens[s] elements each, where
   they lie): out = g + r (torch.add's bits), *counted = how many |sum| >= tc (the reused threshold's
   selection size, which the count band judges), the positions (the concatenation's, ascending) and
   signed sums of |sum| >= tl listed (at most cap written, the count returned goes on past it), and
   *nan = whether a sum is NaN (both tests fail it). tl <= tc lists the threshold's selection among
   others; a higher tl, taken from a sample where the band will re-estimate, lists just enough for the
   exact top-k without a second pass. */
#if defined(AC_AVX2)
__attribute__((target("avx2,popcnt"))) static int64_t add_count_select_avx2(
        const float* g, const float* r, float* out, int64_t n, float tc, float tl, int64_t base, int64_t* idx,
        float* vals, int64_t cap, int64_t* count, int64_t* counted, int* nan) {
    const __m256 cv = _mm256_set1_ps(tc), lv = _mm256_set1_ps(tl), sign = _mm256_set1_ps(-0.0f);
    __m256 bad = _mm256_setzero_ps();
    float blk[64] __attribute__((aligned(32)));
    int64_t c = *count, above = 0, i = 0;
    const int stream = n >= AC_SELECT_STREAM_MIN && ((uintptr_t)out & 31) == 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t m = 0, k = 0;
        AC_AHEAD(g, i, 4);
        AC_AHEAD(r, i, 4);
        for (int q = 0; q < 8; ++q) {
            AC_SUM8(v);
            const __m256 a = _mm256_andnot_ps(sign, v);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, lv, _CMP_GE_OQ)) << (8 * q);
            k |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, cv, _CMP_GE_OQ)) << (8 * q);
        }
        above += __builtin_popcountll(k);
        AC_EMIT64P(m, base + i, blk, 0, blk[j])
    }
    if (stream) _mm_sfence();
    *count = c;
    *counted += above;
    *nan |= _mm256_movemask_ps(bad) != 0;
    return i;
}
#endif
int64_t ac_add_count_select_segments(const int64_t* gs, const int64_t* lens, int64_t nseg, const float* r,
                                     float* out, float tc, float tl, int64_t* idx, float* vals, int64_t cap,
                                     int64_t* counted, int* nan) {
    int64_t c = 0, off = 0;
    *counted = 0;
    *nan = 0;
    for (int64_t s = 0; s < nseg; ++s) {
        const float* g = (const float*)(intptr_t)gs[s];
        const int64_t n = lens[s];
        int64_t i = 0;
#if defined(AC_AVX2)
        if (n >= 64 && use_avx2())
            i = add_count_select_avx2(g, r + off, out + off, n, tc, tl, off, idx, vals, cap, &c, counted, nan);
#endif
        for (; i < n; ++i) {
            const float v = g[i] + r[off + i], a = __builtin_fabsf(v);
            out[off + i] = v;
            if (v != v) *nan = 1;
            *counted += a >= tc;
            if (a >= tl) { if (c < cap) { idx[c] = off + i; vals[c] = v; } ++c; }
        }
        off += n;
    }
    return c;
}
/* ac_add_select_abs_not_lt of g = the concatenation of nseg segments (gs[s], lens[s] elements each)
   read where they lie: a fusion bucket's compensation without its flattened copy (a read and a write
   of the bucket). Positions are the concatenation's; the count goes on past cap. The sums and the
   list are one call's over the flattened g: the same adds and tests, the same ascending order. */
int64_t ac_add_select_segments(const int64_t* gs, const int64_t* lens, int64_t nseg, const float* r,
                               float* out, float t, int64_t* idx, float* vals, int64_t cap) {
    int64_t c = 0, off = 0;
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t at = c < cap ? c : cap;
        const int64_t got = ac_add_select_abs_not_lt((const float*)(intptr_t)gs[s], r + off, out + off, lens[s], t,
                                                     idx + at, vals + at, cap - at, 0, 0);
        for (int64_t j = at; j < c + got && j < cap; ++j) idx[j] += off;
        c += got;
        off += lens[s];
    }
    return c;
}
/* torch's float32 sum of a contiguous tensor on one thread (ATen's SumKernel cascade_sum, the
   vectorized inner sum: the dispatched kernel is the AVX2 one also on AVX-512 CPUs, 8-lane vectors):
   the elements are rows of 4 vectors of 8 lanes; each row adds into 4 x 8 level-0 accumulators, and
   after every full group of 2^lp rows (lp = max(4, ceil(log2 rows) / 4)) level j-1 is added into level
   j, up the levels while the row count is a multiple of the level's span; then the levels are added
   down into level 0, leftover vectors into its first vector, vectors 1-3 into 0, and the scalar sum
   (0, the tail elements, then the 8 lanes in order) is the result. Lane-wise adds: the compiler's
   vectorisation keeps every bit. Callers feed rows (ac_cascade_row) while they stream the data and
   hand the last n - 32 rows elements to ac_cascade_finish; Python checks the result against
   torch.sum once per process before trusting it. */
typedef struct {
    float acc[4][32];
    int64_t row, rows, groups_end;
    int lp;
} ac_cascade;
static void ac_cascade_init(ac_cascade* c, int64_t n) {
    __builtin_memset(c->acc, 0, sizeof(c->acc));
    c->row = 0;
    c->rows = (n / 8) / 4;
    int l = 0;
    while (((int64_t)1 << l) < c->rows) ++l;
    c->lp = l / 4 < 4 ? 4 : l / 4;
    c->groups_end = (c->rows >> c->lp) << c->lp;
}
/* After row c->row (a count) closed a full group: level j-1 into level j, up while the count is a
   multiple of level j's span. */
static void ac_cascade_flush(ac_cascade* c) {
    const int64_t mask = ((int64_t)1 << c->lp) - 1;
    for (int j = 1; j < 4; ++j) {
        for (int l = 0; l < 32; ++l) { c->acc[j][l] += c->acc[j - 1][l]; c->acc[j - 1][l] = 0.0f; }
        if ((c->row & (mask << (j * c->lp))) != 0) break;
    }
}
static inline int ac_cascade_closes(const ac_cascade* c, int64_t count) {
    return count <= c->groups_end && (count & (((int64_t)1 << c->lp) - 1)) == 0;
}
static inline void ac_cascade_row(ac_cascade* c, const float* v) {
    for (int l = 0; l < 32; ++l) c->acc[0][l] += v[l];
    ++c->row;
    if (ac_cascade_closes(c, c->row)) ac_cascade_flush(c);
}
/* The remaining full rows (from row c->row) of v = x, or x + plus (one IEEE add per element) where
   plus is not NULL, with the level-0 accumulators in registers: the cascade of v (|v| when absmode);
   out (may be NULL): v is written there; packed (may be NULL): pack_bits(v >= 0, 1), 4 bytes a row. */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static void ac_cascade_rows_avx2(ac_cascade* c, const float* x, const float* plus,
                                                                 const uint8_t* owed, float os, float* out,
                                                                 int absmode, uint8_t* packed) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    const __m256 oneg = _mm256_set1_ps(-os), opos = _mm256_set1_ps(os);
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const int stream = out && c->rows * 32 >= AC_CASCADE_STREAM_MIN && ((uintptr_t)out & 31) == 0;
    __m256 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm256_loadu_ps(c->acc[0] + 8 * k);
    for (int64_t r = c->row; r < c->rows; ++r) {
        for (int k = 0; k < 4; ++k) {
            const int64_t e = 32 * r + 8 * k;
            __m256 v = _mm256_loadu_ps(x + e);
            if (plus) {
                __m256 q = _mm256_loadu_ps(plus + e);
                if (owed) {  /* the residual plus - decoded signs, then the compensation's add */
                    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(owed[4 * r + k]), bit), bit);
                    q = _mm256_sub_ps(q, _mm256_blendv_ps(oneg, opos, _mm256_castsi256_ps(on)));
                }
                v = _mm256_add_ps(v, q);
            }
            if (stream) _mm256_stream_ps(out + e, v);
            else if (out) _mm256_storeu_ps(out + e, v);
            if (packed) packed[4 * r + k] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ));
            if (absmode) v = _mm256_andnot_ps(sign, v);
            a[k] = _mm256_add_ps(a[k], v);
        }
        if (ac_cascade_closes(c, r + 1)) {
            for (int k = 0; k < 4; ++k) _mm256_storeu_ps(c->acc[0] + 8 * k, a[k]);
            c->row = r + 1;
            ac_cascade_flush(c);
            for (int k = 0; k < 4; ++k) a[k] = _mm256_loadu_ps(c->acc[0] + 8 * k);
        }
    }
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(c->acc[0] + 8 * k, a[k]);
    c->row = c->rows;
    if (stream) _mm_sfence();
}
#endif
/* rest: the n - 32 rows elements after the full rows (leftover vectors, then tail elements) */
static float ac_cascade_finish(ac_cascade* c, const float* rest, int64_t n) {
    for (int j = 1; j < 4; ++j)
        for (int l = 0; l < 32; ++l) c->acc[0][l] += c->acc[j][l];
    const int64_t vecs = n / 8 - 4 * c->rows;
    for (int64_t v = 0; v < vecs; ++v)
        for (int l = 0; l < 8; ++l) c->acc[0][l] += rest[8 * v + l];
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < 8; ++l) c->acc[0][l] += c->acc[0][8 * k + l];
    float s = 0.0f;
    for (int64_t t = 8 * vecs; t < n - 32 * c->rows; ++t) s += rest[t];
    for (int l = 0; l < 8; ++l) s += c->acc[0][l];
    return s;
}
/* One streaming pass over v = x (+ plus) as ac_cascade_rows_avx2 describes, all n >= 8 elements:
   returns the cascade sum of v (|v| when absmode). owed (may be NULL; needs plus): plus stands for
   plus - (bit ? os : -os), bit i of owed (EF-SignSGD's residual not yet subtracted), one IEEE
   subtraction per element before the add, as ac_sign_residual then torch.add would do. */
static float ac_cascade_stream(const float* x, const float* plus, const uint8_t* owed, float os, float* out,
                               int64_t n, int absmode, uint8_t* packed) {
    ac_cascade c;
    float buf[32], vals[32];
    const float otab[2] = {-os, os};
    ac_cascade_init(&c, n);
    AVX2_FIRST(ac_cascade_rows_avx2(&c, x, plus, owed, os, out, absmode, packed))
    const int64_t done = 32 * c.rows;
    for (int64_t r = c.row; r <= c.rows; ++r) {  /* the rows left, then the rest (< 32 elements) */
        const int64_t e0 = 32 * r, len = r < c.rows ? 32 : n - done;
        for (int64_t l = 0; l < len; ++l) {
            const int64_t i = e0 + l;
            const float v = plus ? x[i] + (owed ? plus[i] - otab[(owed[i >> 3] >> (i & 7)) & 1] : plus[i]) : x[i];
            vals[l] = v;
            buf[l] = absmode ? __builtin_fabsf(v) : v;
            if (out) out[e0 + l] = v;
        }
        if (packed)
            for (int64_t j = 0; 8 * j < len; ++j) {
                unsigned m = 0;
                for (int t = 0; t < 8 && 8 * j + t < len; ++t) m |= (unsigned)(vals[8 * j + t] >= 0.0f) << t;
                packed[e0 / 8 + j] = (uint8_t)m;
            }
        if (r < c.rows) ac_cascade_row(&c, buf);
    }
    return ac_cascade_finish(&c, buf, n);
}
/* torch.sum (absmode 0) or torch.abs(x).sum() (absmode 1) of n >= 8 elements, as above. */
float ac_cascade_sum(const float* x, int64_t n, int absmode) {
    return ac_cascade_stream(x, 0, 0, 0.0f, 0, n, absmode, 0);
}
/* torch's float32 (x - t).sum() (absmode: (|x| - t).sum(); one IEEE subtraction per element, as
   torch subtracts a Python float rounded to float32, then the cascade above; n >= 8) without writing
   x - t: SIDCo's later stages fit the exceedances of the previous threshold shifted by it. */
float ac_cascade_sum_shifted(const float* x, int64_t n, float t, int absmode) {
    ac_cascade c;
    float buf[32];
    ac_cascade_init(&c, n);
    for (int64_t r = 0; r < c.rows; ++r) {
        if (absmode) for (int l = 0; l < 32; ++l) buf[l] = __builtin_fabsf(x[32 * r + l]) - t;
        else for (int l = 0; l < 32; ++l) buf[l] = x[32 * r + l] - t;
        ac_cascade_row(&c, buf);
    }
    const int64_t done = 32 * c.rows;
    for (int64_t i = done; i < n; ++i) buf[i - done] = (absmode ? __builtin_fabsf(x[i]) : x[i]) - t;
    return ac_cascade_finish(&c, buf, n);
}
/* SIDCo's later stage in one read of a set: the tensor itself (positions its indices) or kept candidates
   (signed values a[], positions c32[] or c64[]). *count = how many |a| > t; *sum = torch's float32
   (v - t).sum() over those v = |a| (one IEEE subtraction each, then the cascade above, fed row by row
   as the exceedances stream past, none written: ac_cascade_sum_shifted's bits over the exceedances
   in index order); and those with |a| > f (f >= t: where the next threshold is expected, not below)
   compacted as int32 positions and signed values, at most cap written, all counted (the return).
   The cascade's levels depend on the count, which is known only at the end: lp is the caller's guess
   (ac_tail_levels of the count it expects); *lp_out = the count's own, and *sum is valid only where
   the two agree (otherwise the caller calls again with it). Why: SIDCo-E's three stages wrote ~22 % of
   the tensor as candidates, read them for the second fit, selected again for the third and read pairs
   for the pick; this keeps only what the later thresholds can still pass. */
static int ac_tail_levels(int64_t count) {
    const int64_t rows = (count / 8) / 4;
    int l = 0;
    while (((int64_t)1 << l) < rows) ++l;
    return l / 4 < 4 ? 4 : l / 4;
}
static inline int32_t ac_tail_at(const int32_t* c32, const int64_t* c64, int64_t i) {
    return c32 ? c32[i] : c64 ? (int32_t)c64[i] : (int32_t)i;
}
typedef struct {
    ac_cascade c;
    float buf[48];
    int pos;
    int64_t count;
} ac_tail;
static inline void ac_tail_push(ac_tail* s, float v) {
    s->buf[s->pos++] = v;
    ++s->count;
    if (s->pos == 32) { ac_cascade_row(&s->c, s->buf); s->pos = 0; }
}
#if defined(AC_AVX2)
/* A chunk's shifted exceedances are packed into a local buffer first and its rows summed after (not
   a row at a time as they pass: a vector load over slots written by several unaligned stores waits
   for them), and both compactions pack all eight lanes of a block without branching per lane. */
#define AC_TAIL_CHUNK 2048
__attribute__((target("avx2"))) static int64_t ac_tail_avx2(ac_tail* s, const float* a, const int32_t* c32,
                                                           const int64_t* c64, int64_t n, float t, float f,
                                                           int32_t* idx, float* vals, int64_t cap, int64_t* kept) {
    const __m256 tv = _mm256_set1_ps(t), fv = _mm256_set1_ps(f), sign = _mm256_set1_ps(-0.0f);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    float lb[AC_TAIL_CHUNK + 64] __attribute__((aligned(32)));
    ac_cascade cs = s->c;
    int64_t c = *kept, i = 0, pos = s->pos, count = s->count - s->pos;  /* count: the rows' elements */
    for (int l = 0; l < pos; ++l) lb[l] = s->buf[l];
    __m256 acc[4];
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_loadu_ps(cs.acc[0] + 8 * k);
    while (i + 64 <= n) {
        const int64_t end = i + AC_TAIL_CHUNK <= n ? i + AC_TAIL_CHUNK : n - n % 64;
        for (; i < end; i += 64) {
            uint64_t mf = 0;
            AC_AHEAD(a, i, 4);
            for (int q = 0; q < 8; ++q) {
                const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(a + i + 8 * q));
                const unsigned b = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, tv, _CMP_GT_OQ));
                mf |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, fv, _CMP_GT_OQ)) << (8 * q);
                _mm256_storeu_ps(lb + pos, _mm256_permutevar8x32_ps(_mm256_sub_ps(v, tv), compact_perm(ac_compact_lanes, b)));
                pos += __builtin_popcount(b);
            }
            if (!mf) continue;
            if (c + 64 <= cap) {
                for (int q = 0; q < 8; ++q) {
                    const unsigned b = (unsigned)(mf >> (8 * q)) & 0xffu;
                    const __m256i perm = compact_perm(ac_compact_lanes, b);
                    __m256i at;
                    if (c32) at = _mm256_loadu_si256((const __m256i*)(c32 + i + 8 * q));
                    else if (c64) {
                        const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(c64 + i + 8 * q)), even);
                        const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(c64 + i + 8 * q + 4)), even);
                        at = _mm256_permute2x128_si256(lo, hi, 0x20);
                    } else at = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(i + 8 * q)), lane);
                    _mm256_storeu_ps(vals + c, _mm256_permutevar8x32_ps(_mm256_loadu_ps(a + i + 8 * q), perm));
                    _mm256_storeu_si256((__m256i*)(idx + c), _mm256_permutevar8x32_epi32(at, perm));
                    c += __builtin_popcount(b);
                }
                continue;
            }
            while (mf) {
                const int j = __builtin_ctzll(mf);
                mf &= mf - 1;
                if (c < cap) { idx[c] = ac_tail_at(c32, c64, i + j); vals[c] = a[i + j]; }
                ++c;
            }
        }
        const int64_t rows = pos / 32;
        for (int64_t r = 0; r < rows; ++r) {
            for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_ps(acc[k], _mm256_load_ps(lb + 32 * r + 8 * k));
            ++cs.row;
            if (ac_cascade_closes(&cs, cs.row)) {
                for (int k = 0; k < 4; ++k) _mm256_storeu_ps(cs.acc[0] + 8 * k, acc[k]);
                ac_cascade_flush(&cs);
                for (int k = 0; k < 4; ++k) acc[k] = _mm256_loadu_ps(cs.acc[0] + 8 * k);
            }
        }
        count += 32 * rows;
        pos -= 32 * rows;
        if (rows)
            for (int64_t l = 0; l < pos; ++l) lb[l] = lb[32 * rows + l];
    }
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(cs.acc[0] + 8 * k, acc[k]);
    for (int64_t l = 0; l < pos; ++l) s->buf[l] = lb[l];
    s->c = cs;
    s->pos = (int)pos;
    s->count = count + pos;
    *kept = c;
    return i;
}
#endif
int64_t ac_tail_sum_keep(const float* a, const int32_t* c32, const int64_t* c64, int64_t n, float t, int lp, float f,
                         int32_t* idx, float* vals, int64_t cap, int64_t* count, float* sum, int* lp_out) {
    ac_tail s;
    __builtin_memset(&s.c.acc, 0, sizeof(s.c.acc));
    s.c.row = 0;
    s.c.lp = lp;
    s.c.groups_end = INT64_MAX;  /* a streamed row count never passes the final one: every group closes */
    s.pos = 0;
    s.count = 0;
    int64_t c = 0, i = 0;
    AVX2_FIRST(i = ac_tail_avx2(&s, a, c32, c64, n, t, f, idx, vals, cap, &c))
    for (; i < n; ++i) {
        const float v = __builtin_fabsf(a[i]);
        if (v > t) ac_tail_push(&s, v - t);
        if (v > f) { if (c < cap) { idx[c] = ac_tail_at(c32, c64, i); vals[c] = a[i]; } ++c; }
    }
    s.c.rows = s.count / 32;
    *count = s.count;
    *lp_out = ac_tail_levels(s.count);
    *sum = *lp_out == lp ? ac_cascade_finish(&s.c, s.buf, s.count) : 0.0f;
    return c;
}
/* EF-SignSGD's scale and signs in one read: *sum = torch.abs(x).sum() (the cascade above; n >= 8)
   and packed = pack_bits(x >= 0, 1) (ac_pack_nonneg's bytes), no magnitudes written. */
void ac_abs_sum_pack(const float* x, int64_t n, uint8_t* packed, float* sum) {
    *sum = ac_cascade_stream(x, 0, 0, 0.0f, 0, n, 1, packed);
}
/* Error feedback's compensation with a reduction of its result in the same pass: out = g + r (one
   IEEE add per element, as torch.add; out may be g), *sum = the cascade sum of out (of |out| when
   absmode), packed (may be NULL) = pack_bits(out >= 0, 1). n >= 8. */
void ac_add_cascade(const float* g, const float* r, float* out, int64_t n, int absmode, uint8_t* packed,
                    float* sum) {
    *sum = ac_cascade_stream(g, r, 0, 0.0f, out, n, absmode, packed);
}
/* The same with error feedback's residual still owed as base - (bit ? s : -s) (EF-SignSGD's, bit i
   of owed): out = g + (base - decoded), the subtraction ac_sign_residual would have written and
   torch.add's add, in one pass that reads the signs instead of writing and re-reading a residual. */
void ac_add_owed_cascade(const float* g, const float* base, const uint8_t* owed, float s, float* out, int64_t n,
                         int absmode, uint8_t* packed, float* sum) {
    *sum = ac_cascade_stream(g, base, owed, s, out, n, absmode, packed);
}
/* A compaction riding on another pass: the positions and values passing t (> when strict, else >=),
   in index order, at most cap written, c counting all. */
typedef struct {
    float t;
    int strict;
    int64_t* idx;
    float* vals;
    int64_t cap, c;
} ac_sel;
#define AC_SEL_EMIT(S, AT, VALUE)                                                       \
    do {                                                                                \
        if ((S)->c < (S)->cap) { (S)->idx[(S)->c] = (AT); (S)->vals[(S)->c] = (VALUE); } \
        ++(S)->c;                                                                       \
    } while (0)
#if defined(AC_AVX2)
/* AC_EMIT64P into a selection S, from a 64-element block whose values lie at P, inside an AVX2 function */
#define AC_SEL_EMIT64P(S, M, AT, P, VALUE)                                              \
    do {                                                                                \
        int64_t* idx = (S)->idx;                                                        \
        float* vals = (S)->vals;                                                        \
        const int64_t cap = (S)->cap;                                                   \
        int64_t c = (S)->c;                                                             \
        AC_EMIT64P(M, AT, P, 0, VALUE)                                                  \
        (S)->c = c;                                                                     \
    } while (0)
#endif
/* Magnitudes with what a threshold search asks of them, in one pass: out = |x| (the sign bit cleared,
   as torch.abs), their largest and smallest value (stats[0], stats[1]), the first position of the
   largest (*amax) and, for n >= 8, their one-thread torch sum (stats[2], the cascade above): torch's
   max, min, argmax and sum of out, at the cost of the abs pass alone. Returns -1
   when a NaN was met (the caller asks torch then), else 0. With AVX2 each 64-element block keeps its
   largest value; the first block whose largest beats every earlier one is re-read at the end for the
   first position of the maximum. */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t abs_stats_avx2(const float* x, const float* r, float* xs,
                                                              float* out, int64_t n, float* mx, float* mn,
                                                              int64_t* best, int* nan, ac_cascade* cs,
                                                              ac_sel* sel, const int64_t* zi, int64_t zm,
                                                              int64_t* zj) {
    int64_t i = 0;
    const __m256 tv = _mm256_set1_ps(sel ? sel->t : 0.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmn = _mm256_set1_ps(__builtin_inff()), un = _mm256_setzero_ps();
    float m = *mx;
    float blk[64] __attribute__((aligned(32)));  /* the block's magnitudes for the cascade (out may be streamed) */
    float sgn[64] __attribute__((aligned(32)));  /* the block's signed values, which a selection emits */
    const int stream = out != NULL && n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0;
    const int sstream = xs != NULL && n >= AC_STREAM_MIN && ((uintptr_t)xs & 31) == 0;
    int64_t j0 = *zj;
    const int zeroing = r != NULL && zm > 0;
    for (; i + 64 <= n; i += 64) {
        __m256 bmx = _mm256_setzero_ps();
        const uint64_t zero = zeroing ? ac_zero_bits(zi, zm, &j0, i) : 0;
        AC_AHEAD(x, i, 4);
        if (r) AC_AHEAD(r, i, 4);
        for (int q = 0; q < 8; ++q) {
            __m256 v = _mm256_loadu_ps(x + i + 8 * q);
            if (r) {  /* the compensation's sum, written before its magnitude is taken */
                __m256 rv = _mm256_loadu_ps(r + i + 8 * q);
                if (zeroing)  /* a zeroed position's +0.0, without a branch on the block's bits */
                    rv = _mm256_andnot_ps(lanes_of((unsigned)(zero >> (8 * q)) & 0xffu), rv);
                v = _mm256_add_ps(v, rv);
                if (sstream) _mm256_stream_ps(xs + i + 8 * q, v);
                else _mm256_storeu_ps(xs + i + 8 * q, v);
            }
            if (sel) _mm256_store_ps(sgn + 8 * q, v);
            v = _mm256_andnot_ps(sign, v);
            if (stream) _mm256_stream_ps(out + i + 8 * q, v);
            else if (out) _mm256_storeu_ps(out + i + 8 * q, v);
            _mm256_store_ps(blk + 8 * q, v);
            bmx = _mm256_max_ps(bmx, v);
            vmn = _mm256_min_ps(vmn, v);
            un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(bmx), _mm256_extractf128_ps(bmx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float hm = _mm_cvtss_f32(h);
        if (hm > m) { m = hm; *best = i; }
        if (cs) { ac_cascade_row(cs, blk); ac_cascade_row(cs, blk + 32); }
        if (sel) {
            uint64_t mk = 0;
            for (int q = 0; q < 8; ++q) {
                const __m256 w = _mm256_load_ps(blk + 8 * q);
                const __m256 p = sel->strict ? _mm256_cmp_ps(w, tv, _CMP_GT_OQ) : _mm256_cmp_ps(w, tv, _CMP_GE_OQ);
                mk |= (uint64_t)(unsigned)_mm256_movemask_ps(p) << (8 * q);
            }
            AC_SEL_EMIT64P(sel, mk, i, sgn, sgn[j]);
        }
    }
    if (stream || sstream) _mm_sfence();
    float lanes[8];
    _mm256_storeu_ps(lanes, vmn);
    for (int q = 0; q < 8; ++q) *mn = lanes[q] < *mn ? lanes[q] : *mn;
    *nan = _mm256_movemask_ps(un) != 0;
    *mx = m;
    *zj = j0;
    return i;
}
#endif
/* x + r (r not NULL: error feedback's compensation, one IEEE add per element as torch.add, written to
   xs) or x itself, and ac_abs_stats's statistics of its magnitudes; with sel, also the positions
   ac_select_abs_gt / ac_select_abs_ge list, with the signed values there (a payload's values come
   from them, not from a gather over the tensor). */
static int abs_stats_of(const float* x, const float* r, float* xs, float* out, int64_t n, float* stats,
                        int64_t* amax, ac_sel* sel, const int64_t* zi, int64_t zm) {
    int64_t i = 0, best = -1, am = -1, j = 0;
    float mx = -1.0f, mn = __builtin_inff();
    int nan = 0;
    ac_cascade cs;
    ac_cascade_init(&cs, n);
    const float* src = r ? xs : x;  /* where the values whose magnitudes count are, once written */
#if defined(AC_AVX2)
    if (use_avx2()) {
        i = abs_stats_avx2(x, r, xs, out, n, &mx, &mn, &best, &nan, n >= 8 ? &cs : 0, sel, zi, zm, &j);
        if (nan) {
            for (; r && i < n; ++i) {  /* the sum is whole whatever the statistics */
                const int zeroed = j < zm && zi[j] == i;
                j += zeroed;
                xs[i] = x[i] + (zeroed ? 0.0f : r[i]);
            }
            return -1;
        }
        if (best >= 0)
            for (am = best; __builtin_fabsf(src[am]) != mx; ++am) {}
    }
#endif
    for (; i < n; ++i) {
        float s = x[i];
        if (r) {
            const int zeroed = j < zm && zi[j] == i;
            j += zeroed;
            s = s + (zeroed ? 0.0f : r[i]);
            xs[i] = s;
        }
        const float v = __builtin_fabsf(s);
        if (out) out[i] = v;
        if (v != v) nan = 1;
        if (v > mx) { mx = v; am = i; }
        if (v < mn) mn = v;
        if (sel && (sel->strict ? v > sel->t : v >= sel->t)) AC_SEL_EMIT(sel, i, s);
    }
    if (nan) return -1;
    stats[0] = mx;
    stats[1] = mn;
    *amax = am;
    if (n >= 8) {  /* the rows the AVX2 loop did not feed, from out (just written: in cache) or the values */
        float row[32];
        while (cs.row < cs.rows) {
            if (out) { ac_cascade_row(&cs, out + 32 * cs.row); continue; }
            for (int t = 0; t < 32; ++t) row[t] = __builtin_fabsf(src[32 * cs.row + t]);
            ac_cascade_row(&cs, row);
        }
        if (!out)
            for (int64_t t = 32 * cs.rows; t < n; ++t) row[t - 32 * cs.rows] = __builtin_fabsf(src[t]);
        stats[2] = ac_cascade_finish(&cs, out ? out + 32 * cs.rows : row, n);
    }
    return 0;
}
int ac_abs_stats(const float* x, float* out, int64_t n, float* stats, int64_t* amax) {
    /* out NULL: the statistics alone, |x| formed again where the cascade needs it (a search that
       counts on x's magnitudes itself then never writes them) */
    return abs_stats_of(x, 0, 0, out, n, stats, amax, 0, 0, 0);
}
/* Error feedback's compensation with what RedSync's and MSTop-k's searches read first of its result:
   sum = g + r (torch.add's bits; sum may be g), the statistics of |sum| ac_abs_stats(sum, NULL) gives
   and (idx not NULL) the search's candidates, |sum| > t (strict) or >= t, with their signed sums, at
   most cap written: three passes in one. zi (zm positions, strictly ascending, in [0, n): the caller
   checks with ac_ascending_within): where r is read as +0.0, the zeroing of the coordinates the
   previous step sent (error feedback's residual), done here instead of by ac_zero_at on the stored r
   (each zeroed position there a write miss: ~0.2 memory floors of a sparsifier's step).
   Returns how many passed, or -1 on a NaN (sum is still written in full). */
int64_t ac_add_abs_stats_select(const float* g, const float* r, float* sum, int64_t n, float* stats, int64_t* amax,
                                float t, int strict, int64_t* idx, float* vals, int64_t cap, const int64_t* zi,
                                int64_t zm) {
    ac_sel sel = {t, strict, idx, vals, cap, 0};
    if (abs_stats_of(g, r, sum, 0, n, stats, amax, idx ? &sel : 0, zi, zm) != 0) return -1;  /* idx NULL: no selection */
    return sel.c;
}
/* Gaussian-k's moments and its search's candidates in one read: *sumsq = the sum of the terms
   ((double)x - mean)^2 and the positions of |x| > t as ac_select_abs_gt lists them, with the signed x
   there (the payload's values).
   torch.std sums those terms in index order, one dependent double add after another (latency-bound:
   ~0.5 ns an element). With lanes != 0 and AVX2 the same terms are summed in 16 double lanes (each
   in index order, then the lanes in a fixed tree; the tail of up to 63 terms last): *lanes_used = 1
   and the caller, which knows both sums lie within a proven distance of the exact one, decides
   whether the float32 std can differ and sums again in order where it can. Else the in-order chain
   (*lanes_used = 0), with the comparisons and compaction beside it at no cost. Returns how many
   passed (writing at most cap). */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t sumsq_select_avx2(const float* x, int64_t n, double mean, float t,
                                                                 int64_t* idx, float* vals, int64_t cap,
                                                                 double* sum, int64_t* count, int lanes) {
    int64_t c = 0, i = 0;
    double acc = *sum;
    const __m256 tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f);
    const __m256d mv = _mm256_set1_pd(mean);
    __m256d l0 = _mm256_setzero_pd(), l1 = l0, l2 = l0, l3 = l0;
    for (; i + 64 <= n; i += 64) {
        uint64_t m = 0;
        for (int q = 0; q < 8; ++q)
            m |= (uint64_t)(unsigned)_mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8 * q)), tv, _CMP_GT_OQ)) << (8 * q);
        if (lanes) {
            for (int q = 0; q < 64; q += 16) {
                const __m256d d0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + q)), mv);
                const __m256d d1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + q + 4)), mv);
                const __m256d d2 = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + q + 8)), mv);
                const __m256d d3 = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + q + 12)), mv);
                l0 = _mm256_add_pd(l0, _mm256_mul_pd(d0, d0));
                l1 = _mm256_add_pd(l1, _mm256_mul_pd(d1, d1));
                l2 = _mm256_add_pd(l2, _mm256_mul_pd(d2, d2));
                l3 = _mm256_add_pd(l3, _mm256_mul_pd(d3, d3));
            }
        } else {
            for (int j = 0; j < 64; ++j) {
                const double d = (double)x[i + j] - mean;
                acc = acc + d * d;
            }
        }
        AC_EMIT64P(m, i, x + i, 0, x[i + j])
    }
    if (lanes) {
        double v[4];
        _mm256_storeu_pd(v, _mm256_add_pd(_mm256_add_pd(l0, l1), _mm256_add_pd(l2, l3)));
        acc = (v[0] + v[1]) + (v[2] + v[3]);
    }
    *sum = acc;
    *count = c;
    return i;
}
#endif
int64_t ac_sumsq_select_abs_gt(const float* x, int64_t n, double mean, float t, int64_t* idx, float* vals,
                               int64_t cap, double* sumsq, int lanes, int* lanes_used) {
    int64_t c = 0, i = 0;
    double acc = 0.0;
    *lanes_used = 0;
#if defined(AC_AVX2)
    if (use_avx2()) {
        i = sumsq_select_avx2(x, n, mean, t, idx, vals, cap, &acc, &c, lanes);
        *lanes_used = lanes != 0;
    }
#endif
    for (; i < n; ++i) {
        const double d = (double)x[i] - mean;
        acc = acc + d * d;
        if (__builtin_fabsf(x[i]) > t) { if (c < cap) { idx[c] = i; vals[c] = x[i]; } ++c; }
    }
    *sumsq = acc;
    return c;
}
/* Gaussian-k's compensation with everything its search reads, in one pass: sum = g + r (torch.add's
   bits; sum aliases neither), *total = torch's one-thread float32 sum of it (the cascade above),
   moments[0] and moments[1] = the sums of sum^2 and of sum in 16 double lanes each (a lane is a chain
   of at most n / 16 + 4 adds, the lanes then added in a fixed tree: the caller bounds the error of
   that chain length, and of the float32 squares none, exact in double), and the positions of
   |sum| > t with the signed sums there (ac_select_abs_gt's list, at most cap written). Returns how
   many passed. n >= 64. Why: the moments' own read of the compensated tensor was half a memory floor
   of Gaussian-k's step (issue 32); torch.std's sum of squared deviations follows from these two sums
   within a bound the caller proves, and only where that bound straddles a float32 rounding does a
   read in torch's order remain. */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t add_moments_avx2(const float* g, const float* r, float* sum, int64_t n,
                                                                ac_cascade* cs, ac_sel* sel, double* lanes2,
                                                                double* lanes1) {
    int64_t i = 0;
    const __m256 tv = _mm256_set1_ps(sel->t), sign = _mm256_set1_ps(-0.0f);
    __m256d q2[4], q1[4];
    for (int k = 0; k < 4; ++k) { q2[k] = _mm256_setzero_pd(); q1[k] = _mm256_setzero_pd(); }
    float blk[64] __attribute__((aligned(32)));
    const int stream = n >= AC_STREAM_MIN && ((uintptr_t)sum & 31) == 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t mk = 0;
        AC_AHEAD(g, i, 4);
        AC_AHEAD(r, i, 4);
        for (int q = 0; q < 8; ++q) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i + 8 * q), _mm256_loadu_ps(r + i + 8 * q));
            if (stream) _mm256_stream_ps(sum + i + 8 * q, v);
            else _mm256_storeu_ps(sum + i + 8 * q, v);
            _mm256_store_ps(blk + 8 * q, v);
            mk |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), tv, _CMP_GT_OQ))
                  << (8 * q);
            const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            const int k = 2 * (q & 1);
            q2[k] = _mm256_add_pd(q2[k], _mm256_mul_pd(lo, lo));
            q2[k + 1] = _mm256_add_pd(q2[k + 1], _mm256_mul_pd(hi, hi));
            q1[k] = _mm256_add_pd(q1[k], lo);
            q1[k + 1] = _mm256_add_pd(q1[k + 1], hi);
        }
        ac_cascade_row(cs, blk);
        ac_cascade_row(cs, blk + 32);
        AC_SEL_EMIT64P(sel, mk, i, blk, blk[j]);
    }
    if (stream) _mm_sfence();
    for (int k = 0; k < 4; ++k) { _mm256_storeu_pd(lanes2 + 4 * k, q2[k]); _mm256_storeu_pd(lanes1 + 4 * k, q1[k]); }
    return i;
}
#endif
int64_t ac_add_moments_select(const float* g, const float* r, float* sum, int64_t n, float t, int64_t* idx,
                              float* vals, int64_t cap, float* total, double* moments) {
    ac_sel sel = {t, 1, idx, vals, cap, 0};
    ac_cascade cs;
    double l2[16] = {0}, l1[16] = {0};
    int64_t i = 0;
    ac_cascade_init(&cs, n);
#if defined(AC_AVX2)
    if (use_avx2()) i = add_moments_avx2(g, r, sum, n, &cs, &sel, l2, l1);
#endif
    for (; i < n; ++i) {
        const float v = g[i] + r[i];
        sum[i] = v;
        l2[i & 15] += (double)v * (double)v;
        l1[i & 15] += (double)v;
        if (__builtin_fabsf(v) > t) AC_SEL_EMIT(&sel, i, v);
    }
    while (cs.row < cs.rows) ac_cascade_row(&cs, sum + 32 * cs.row);  /* just written: in cache */
    *total = ac_cascade_finish(&cs, sum + 32 * cs.rows, n);
    for (int w = 8; w >= 1; w /= 2)
        for (int k = 0; k < w; ++k) { l2[k] += l2[k + w]; l1[k] += l1[k + w]; }
    moments[0] = l2[0];
    moments[1] = l1[0];
    return sel.c;
}
/* The same selection with one threshold per row of an (m, n) row-major matrix (ascending flat
   indices): the row-wise prefilter of ADTopk's per-row Top-k. */
#define SELECT_ROWS(NAME, INNER)                                                        \
int64_t NAME(const float* base, int64_t m, int64_t n, const float* thr, int64_t* idx, float* vals, \
             int64_t cap) {                                                             \
    int64_t total = 0;                                                                  \
    for (int64_t r = 0; r < m; ++r) {                                                   \
        int64_t c = INNER(base + r * n, n, thr[r], idx + (total < cap ? total : cap),    \
                          vals + (total < cap ? total : cap), total < cap ? cap - total : 0); \
        if (total < cap) {                                                              \
            int64_t w = c < cap - total ? c : cap - total;                              \
            for (int64_t i = 0; i < w; ++i) idx[total + i] += r * n;                    \
        }                                                                               \
        total += c;                                                                     \
    }                                                                                   \
    return total;                                                                       \
}
SELECT_ROWS(ac_select_rows_ge, ac_select_ge)
SELECT_ROWS(ac_select_rows_not_lt, ac_select_not_lt)
SELECT_ROWS(ac_select_rows_abs_ge, ac_select_abs_ge)
SELECT_ROWS(ac_select_rows_abs_not_lt, ac_select_abs_not_lt)
/* ADTopk's block maxima of |x| for one row u of n floats (as bits): acc[j] = max over c < n / b of
   |u[c * b + j]| (strided blocks: the inner loop runs along the row, one lane per block), a NaN's
   bits where one is NaN (|x| orders as its bits, NaN above infinity). */
static inline void block_max_keys(const uint32_t* u, int64_t n, int64_t b, uint32_t* acc) {
    const int64_t bs = n / b;
    for (int64_t j = 0; j < b; ++j) acc[j] = u[j] & 0x7fffffffu;
    for (int64_t c = 1; c < bs; ++c) {
        const uint32_t* v = u + c * b;
        for (int64_t j = 0; j < b; ++j) {
            const uint32_t k = v[j] & 0x7fffffffu;
            acc[j] = k > acc[j] ? k : acc[j];
        }
    }
}
/* DGC's momentum correction in one pass: u = u * m + g (two roundings, as torch's mul_ then add_),
   out = v + u. */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t momentum_accumulate_avx2(const float* u, const float* g,
                                                                        const float* v, float* u_out, float* v_out,
                                                                        int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i < n && ((uintptr_t)(u_out + i) & 31); ++i) {
        const float t = u[i] * m + g[i];
        u_out[i] = t;
        v_out[i] = v[i] + t;
    }
    if (((uintptr_t)(v_out + i) & 31) != 0) return i;  /* the outputs' alignments differ: the plain loop */
    for (; i + 8 <= n; i += 8) {
        const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(u + i), mv), _mm256_loadu_ps(g + i));
        _mm256_stream_ps(u_out + i, t);
        _mm256_stream_ps(v_out + i, _mm256_add_ps(_mm256_loadu_ps(v + i), t));
    }
    _mm_sfence();
    return i;
}
#endif
AC_CLONES void ac_momentum_accumulate(const float* u, const float* g, const float* v, float* u_out, float* v_out,
                            int64_t n, float m) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (n >= AC_STREAM_MIN && use_avx2()) i = momentum_accumulate_avx2(u, g, v, u_out, v_out, n, m);
#endif
    for (; i < n; ++i) {
        float t = u[i] * m;
        t = t + g[i];
        u_out[i] = t;
        v_out[i] = v[i] + t;
    }
}
/* The same momentum correction with DGC's candidates from the pass: the positions of the new v
   passing |v| >= t, with the signed v there (the payload's values), ascending (the set ac_select_abs_ge finds over v_out afterwards, one
   read of v_out less). 64 elements a mask with AVX2, streamed to 32-byte aligned outputs from
   AC_SELECT_STREAM_MIN elements (the next step reads them from memory anyway).
   zi (zm positions, strictly ascending, in [0, n): the caller checks with ac_ascending_within):
   where u and v are read as +0.0, the masking of the coordinates the previous step sent, done
   here instead of by ac_zero_at on the stored u and v (each zeroed position there a write miss:
   VGG-16, 2 x 1.4M of them, 34 ms of a 260 ms step on the Xeon). */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t momentum_select_avx2(
        const float* u, const float* g, const float* v, float* u_out, float* v_out, int64_t n, float m, float t,
        int64_t* idx, float* vals, int64_t cap, int64_t* count, const int stream, const int64_t* zi, int64_t zm,
        int64_t* zj) {
    const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f);
    float blk[64] __attribute__((aligned(32)));  /* the block's signed v */
    int64_t c = *count, i = 0, j0 = *zj;
    const int zeroing = zm > 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t mask = 0;
        const uint64_t zero = zeroing ? ac_zero_bits(zi, zm, &j0, i) : 0;
        for (int q = 0; q < 8; ++q) {
            const int64_t o = i + 8 * q;
            __m256 uu = _mm256_loadu_ps(u + o), vv = _mm256_loadu_ps(v + o);
            if (zeroing) {  /* without a branch on the block's bits (ac_zero_bits) */
                const __m256 zl = lanes_of((unsigned)(zero >> (8 * q)) & 0xffu);
                uu = _mm256_andnot_ps(zl, uu);
                vv = _mm256_andnot_ps(zl, vv);
            }
            const __m256 a = _mm256_add_ps(_mm256_mul_ps(uu, mv), _mm256_loadu_ps(g + o));
            const __m256 w = _mm256_add_ps(vv, a), b = _mm256_andnot_ps(sign, w);
            if (stream) { _mm256_stream_ps(u_out + o, a); _mm256_stream_ps(v_out + o, w); }
            else { _mm256_storeu_ps(u_out + o, a); _mm256_storeu_ps(v_out + o, w); }
            _mm256_store_ps(blk + 8 * q, w);
            mask |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(b, tv, _CMP_GE_OQ)) << (8 * q);
        }
        AC_EMIT64P(mask, i, blk, 0, blk[j])
    }
    if (stream) _mm_sfence();
    *count = c;
    *zj = j0;
    return i;
}
#endif
int64_t ac_momentum_select_abs_ge(const float* u, const float* g, const float* v, float* u_out, float* v_out,
                                  int64_t n, float m, float t, int64_t* idx, float* vals, int64_t cap,
                                  const int64_t* zi, int64_t zm) {
    int64_t c = 0, i = 0, j = 0;
#if defined(AC_AVX2)
    if (n >= 64 && use_avx2()) {
        const int aligned = ((uintptr_t)u_out & 31) == 0 && ((uintptr_t)v_out & 31) == 0;
        i = momentum_select_avx2(u, g, v, u_out, v_out, n, m, t, idx, vals, cap, &c,
                                 aligned && n >= AC_SELECT_STREAM_MIN, zi, zm, &j);
    }
#endif
    for (; i < n; ++i) {
        const int zeroed = j < zm && zi[j] == i;
        j += zeroed;
        float a = (zeroed ? 0.0f : u[i]) * m;
        a = a + g[i];
        u_out[i] = a;
        const float w = (zeroed ? 0.0f : v[i]) + a;
        v_out[i] = w;
        if (__builtin_fabsf(w) >= t) { if (c < cap) { idx[c] = i; vals[c] = w; } ++c; }
    }
    return c;
}
/* 1 where the m positions are strictly ascending and within [0, n), else 0. */
int ac_ascending_within(const int64_t* idx, int64_t m, int64_t n) {
    int64_t prev = -1;
    for (int64_t i = 0; i < m; ++i) {
        if (idx[i] <= prev || idx[i] >= n) return 0;
        prev = idx[i];
    }
    return 1;
}
/* kept[i] = whether a[i] is among b's m values (a's n and b's m both ascending): a merge, one read
   of each (torch.isin sorts both first). */
void ac_sorted_member(const int64_t* a, int64_t n, const int64_t* b, int64_t m, uint8_t* kept) {
    int64_t j = 0;
    for (int64_t i = 0; i < n; ++i) {
        while (j < m && b[j] < a[i]) ++j;
        kept[i] = j < m && b[j] == a[i];
    }
}
/* The sum of the values sharing a position over `parts` runs of strictly ascending positions
   idx[p] (values vals[p], counts[p]): ascending distinct positions into out_idx and each one's
   +0.0 + v_0 + v_1 ... in run order into out_vals (torch.unique then index_add_ into zeros: the same
   bits). A merge, one read of each run; pos: parts int64 of scratch. Returns how many. */
int64_t ac_merge_sum(int parts, const int64_t* const* idx, const float* const* vals, const int64_t* counts,
                     int64_t* pos, int64_t* out_idx, float* out_vals) {
    int64_t w = 0;
    for (int p = 0; p < parts; ++p) pos[p] = 0;
    for (;;) {
        int64_t low = INT64_MAX;
        for (int p = 0; p < parts; ++p)
            if (pos[p] < counts[p] && idx[p][pos[p]] < low) low = idx[p][pos[p]];
        if (low == INT64_MAX) return w;
        float sum = 0.0f;
        for (int p = 0; p < parts; ++p)
            if (pos[p] < counts[p] && idx[p][pos[p]] == low) sum += vals[p][pos[p]++];
        out_idx[w] = low;
        out_vals[w++] = sum;
    }
}
/* Counted in blocks into a 32-bit counter, which the compiler vectorises (a 64-bit one it does
   not, on SSE2). */
#define COUNT_T(NAME, PASS, VAL)                                                        \
AC_CLONES int64_t NAME(const float* a, int64_t n, float t) {                           \
    int64_t c = 0;                                                                      \
    for (int64_t i0 = 0; i0 < n; i0 += 1 << 16) {                                       \
        const int64_t e = n - i0 < (1 << 16) ? n - i0 : (1 << 16);                      \
        int32_t cb = 0;                                                                 \
        for (int64_t i = 0; i < e; ++i) { float v = VAL(a[i0 + i]); cb += (PASS) ? 1 : 0; } \
        c += cb;                                                                        \
    }                                                                                   \
    return c;                                                                           \
}
#define COUNT(NAME, PASS) COUNT_T(NAME, PASS, AS_IS)
/* The r-th largest (1-based) of a[0], a[step], a[2 step], ... (m elements) by an 8-bit radix
   select on the float bits: for non-negative floats the bit patterns order as the values, NaN
   above inf. Returns 0 and writes the value's bits, or -1 (a negative value or a NaN: the caller
   takes torch's path, where NaN ranks first and the minimum of a top-r holding NaN is NaN). */
/* The r-th largest (1-based) of the m patterns src[i * step] & mask (non-negative floats order as
   their bit patterns) by radix select: a first digit of up to 12 bits over the keys' range (their
   minimum subtracted), read from src, then 10-bit digits over the keys of the chosen bin, compacted
   into `keys` (scratch of m); each bin scan starts at the largest key's bin, and 48 keys or fewer
   are sorted instead. *kth gets the value's
   pattern and *ties_rank its rank among the keys equal to it (so r - *ties_rank keys are larger).
   -1 on a NaN or, without the sign cleared, a negative value (torch answers). */
#define RADIX_SMALL 48
static void small_kth(uint32_t* keys, int64_t m, int64_t r, uint32_t* kth, int64_t* ties_rank) {
    for (int64_t i = 1; i < m; ++i) {  /* insertion sort, descending */
        const uint32_t v = keys[i];
        int64_t j = i;
        while (j > 0 && keys[j - 1] < v) { keys[j] = keys[j - 1]; --j; }
        keys[j] = v;
    }
    const uint32_t t = keys[r - 1];
    int64_t above = 0;
    while (keys[above] > t) ++above;
    *kth = t;
    *ties_rank = r - above;
}
/* The r-th largest of m keys (bit patterns of non-negative floats, no NaN) in `keys` (reordered):
   digits of `width` bits from bit `shift` down (the last digit the bits left), bins above the
   largest key's never scanned. */
static void keys_kth(uint32_t* keys, int64_t m, int64_t r, int shift, int width, uint32_t* kth,
                     int64_t* ties_rank) {
    uint32_t hist[1024];
    for (;;) {
        if (m <= RADIX_SMALL) { small_kth(keys, m, r, kth, ties_rank); return; }
        const int sh = shift < 0 ? 0 : shift;
        const uint32_t bm = (shift < 0 ? 1u << (width + shift) : 1u << width) - 1u;
        for (uint32_t d = 0; d <= bm; ++d) hist[d] = 0;
        uint32_t hb = 0;
        for (int64_t i = 0; i < m; ++i) {
            const uint32_t b = (keys[i] >> sh) & bm;
            hist[b]++;
            hb = b > hb ? b : hb;
        }
        int64_t cum = 0;
        uint32_t d;
        for (d = hb; d > 0; --d) { if (cum + (int64_t)hist[d] >= r) break; cum += hist[d]; }
        r -= cum;
        int64_t w = 0;
        uint32_t kmin = 0xffffffffu, kmax = 0;
        for (int64_t i = 0; i < m; ++i)
            if (((keys[i] >> sh) & bm) == d) {
                const uint32_t k = keys[i];
                keys[w++] = k;
                kmin = k < kmin ? k : kmin;
                kmax = k > kmax ? k : kmax;
            }
        m = w;
        /* every key left is one value (a sample of mostly exact zeros): it is the answer, no more digits */
        if (sh == 0 || kmin == kmax) { *kth = keys[0]; *ties_rank = r; return; }
        shift -= width;
    }
}
#if defined(AC_AVX2)
/* the smallest and largest of m contiguous keys src[i] & mask, 8 lanes at a time; returns how many it read */
__attribute__((target("avx2"))) static int64_t key_range_avx2(const uint32_t* src, uint32_t mask, int64_t m,
                                                             uint32_t* low, uint32_t* top) {
    const __m256i mk = _mm256_set1_epi32((int)mask);
    __m256i lo = _mm256_set1_epi32(-1), hi = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        const __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(src + i)), mk);
        lo = _mm256_min_epu32(lo, v);
        hi = _mm256_max_epu32(hi, v);
    }
    uint32_t l[8], h[8];
    _mm256_storeu_si256((__m256i*)l, lo);
    _mm256_storeu_si256((__m256i*)h, hi);
    for (int q = 0; q < 8; ++q) { *low = l[q] < *low ? l[q] : *low; *top = h[q] > *top ? h[q] : *top; }
    return i;
}
#endif
#if defined(AC_AVX2)
/* The least lane of `least` and the largest of `most` (unsigned), into *lo and *hi. */
__attribute__((target("avx2"))) static void lanes_range(__m256i least, __m256i most, uint32_t* lo, uint32_t* hi) {
    uint32_t l8[8], h8[8];
    _mm256_storeu_si256((__m256i*)l8, least);
    _mm256_storeu_si256((__m256i*)h8, most);
    *lo = 0xffffffffu;
    *hi = 0;
    for (int j = 0; j < 8; ++j) {
        *lo = l8[j] < *lo ? l8[j] : *lo;
        *hi = h8[j] > *hi ? h8[j] : *hi;
    }
}
/* How many of the n keys src[i] & mask (each below 2^31 after the mask: signed compares) are >= t. */
__attribute__((target("avx2,popcnt"))) static int64_t keys_count_ge_avx2(const uint32_t* src, uint32_t mask, int64_t n,
                                                                        uint32_t t) {
    const __m256i tv = _mm256_set1_epi32((int)(t - 1u)), mv = _mm256_set1_epi32((int)mask);
    int64_t c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i kv = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(src + i)), mv);
        c += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(kv, tv))));
    }
    for (; i < n; ++i) c += (src[i] & mask) >= t;
    return c;
}
/* The least of the n keys src[i] & mask that are >= t (one at least). */
__attribute__((target("avx2"))) static uint32_t keys_least_from_avx2(const uint32_t* src, uint32_t mask, int64_t n,
                                                                    uint32_t t) {
    const __m256i tv = _mm256_set1_epi32((int)(t - 1u)), mv = _mm256_set1_epi32((int)mask), ones = _mm256_set1_epi32(-1);
    __m256i lo = ones;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i kv = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(src + i)), mv);
        lo = _mm256_min_epu32(lo, _mm256_blendv_epi8(ones, kv, _mm256_cmpgt_epi32(kv, tv)));
    }
    uint32_t least, unused;
    lanes_range(lo, _mm256_setzero_si256(), &least, &unused);
    for (; i < n; ++i) {
        const uint32_t u = src[i] & mask;
        least = u >= t && u < least ? u : least;
    }
    return least;
}
/* The keys src[i] & mask within [lo, hi] moved to dst in order (dst may be src: a store never passes
   the keys not read yet), with their least and largest (*wlo, *whi); *above += how many exceed hi.
   Returns how many moved. */
__attribute__((target("avx2,popcnt"))) static int64_t keys_window_avx2(const uint32_t* src, uint32_t mask, int64_t n,
                                                                      uint32_t lo, uint32_t hi, uint32_t* dst,
                                                                      int64_t* above, uint32_t* wlo, uint32_t* whi) {
    const __m256i lo_v = _mm256_set1_epi32((int)(lo - 1u)), hi_v = _mm256_set1_epi32((int)hi);
    const __m256i mv = _mm256_set1_epi32((int)mask), ones = _mm256_set1_epi32(-1);
    __m256i least = ones, most = _mm256_setzero_si256();
    int64_t w = 0, a = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i kv = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(src + i)), mv);
        const __m256i over = _mm256_cmpgt_epi32(kv, hi_v);
        const __m256i in = _mm256_andnot_si256(over, _mm256_cmpgt_epi32(kv, lo_v));
        const unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(in));
        a += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(over)));
        least = _mm256_min_epu32(least, _mm256_blendv_epi8(ones, kv, in));
        most = _mm256_max_epu32(most, _mm256_and_si256(kv, in));
        _mm256_storeu_si256((__m256i*)(dst + w), _mm256_permutevar8x32_epi32(kv, compact_perm(ac_compact_lanes, bits)));
        w += __builtin_popcount(bits);
    }
    uint32_t wl, wh;
    lanes_range(least, most, &wl, &wh);
    for (; i < n; ++i) {
        const uint32_t u = src[i] & mask;
        if (u > hi) { ++a; continue; }
        if (u < lo) continue;
        dst[w++] = u;
        wl = u < wl ? u : wl;
        wh = u > wh ? u : wh;
    }
    *above += a;
    *wlo = wl;
    *whi = wh;
    return w;
}
/* radix_kth's answer (step 1) with vector passes, and *reach: how many keys reach the r-th largest
   (r when no tie at it is cut). The bits of the r-th largest are bisected from the first one where the
   keys' least and largest differ, each set where at least r keys reach the value so far; where exactly
   r reach it, the r-th largest is the least of them. Every four bits the keys still in the value's
   window move to `keys` (those above it counted once), and the window's own least and largest skip
   the bits its keys share: so ~5 vector passes over the keys and a few over a sixteenth of them,
   where the radix select's histogram and compaction run one key at a time (~4x the time, and the
   candidates' k-th of a Chunk-Top-k chunk ~2x). keys: scratch of m. -1 on a NaN (or, without the sign
   cleared, a negative value). */
__attribute__((target("avx2,popcnt"))) static int kth_avx2(const uint32_t* src, uint32_t mask, int64_t m, int64_t r,
                                                          uint32_t* keys, uint32_t* kth, int64_t* ties,
                                                          int64_t* reach) {
    uint32_t lo = 0xffffffffu, top = 0;
    int64_t i = key_range_avx2(src, mask, m, &lo, &top);
    for (; i < m; ++i) {
        const uint32_t u = src[i] & mask;
        lo = u < lo ? u : lo;
        top = u > top ? u : top;
    }
    if (top > 0x7f800000u) return -1;  /* a NaN, or a sign bit left by the mask */
    const uint32_t* a = src;
    uint32_t am = mask, v;
    int64_t n = m, above = 0;  /* a holds the window's n keys; `above` keys exceed it (fewer than r) */
    for (;;) {
        if (lo == top) { *kth = top; *ties = r - above; *reach = above + n; return 0; }
        const int high = 31 - __builtin_clz(lo ^ top);
        v = top & ~((2u << high) - 1u);  /* the bits the window's keys share */
        const int last = n <= 64 || high < 4 ? 0 : high - 3;  /* this round's bits: high .. last */
        int exact = 0;
        for (int b = high; b >= last; --b) {
            const uint32_t c_v = v | (1u << b);
            const int64_t c = above + keys_count_ge_avx2(a, am, n, c_v);
            if (c < r) continue;
            v = c_v;
            if (c == r) { v = keys_least_from_avx2(a, am, n, c_v); exact = 1; break; }
        }
        if (exact || last == 0) break;
        n = keys_window_avx2(a, am, n, v, v + ((1u << last) - 1u), keys, &above, &lo, &top);
        a = keys;
        am = 0xffffffffu;
    }
    *kth = v;
    *reach = above + keys_count_ge_avx2(a, am, n, v);
    *ties = r - above - (v == 0x7fffffffu ? 0 : keys_count_ge_avx2(a, am, n, v + 1u));
    return 0;
}
#endif
static int radix_kth(const uint32_t* src, int64_t step, uint32_t mask, int64_t m, int64_t r,
                     uint32_t* keys, uint32_t* kth, int64_t* ties_rank) {
#if defined(AC_AVX2)
    if (step == 1 && r >= 1 && r <= m && use_avx2()) {
        int64_t reach;
        return kth_avx2(src, mask, m, r, keys, kth, ties_rank, &reach);
    }
#endif
    uint32_t top = 0, low = 0xffffffffu;
    int64_t i0 = 0;
#if defined(AC_AVX2)
    if (step == 1 && use_avx2()) i0 = key_range_avx2(src, mask, m, &low, &top);
#endif
    for (int64_t i = i0; i < m; ++i) {
        const uint32_t u = src[i * step] & mask;
        top = u > top ? u : top;
        low = u < low ? u : low;
    }
    if (top > 0x7f800000u) return -1;
    /* the first digit spans the keys' own range, [low, top], in at most 4096 bins: a prefilter's
       candidates (all just above its floor) share their top 12 bits, so a fixed first digit left
       them all in one or two bins and two more levels over all of them (3 ns per candidate on
       ResNet-50's Top-k; ~1.5 now) */
    int shift = 0;
    while (((top - low) >> shift) >= 4096u) ++shift;
    const uint32_t nb = ((top - low) >> shift) + 1u;
    uint32_t hist[4096];
    for (uint32_t d = 0; d < nb; ++d) hist[d] = 0;
    for (int64_t i = 0; i < m; ++i) hist[((src[i * step] & mask) - low) >> shift]++;
    int64_t cum = 0;
    uint32_t d;
    for (d = nb - 1; d > 0; --d) { if (cum + (int64_t)hist[d] >= r) break; cum += hist[d]; }
    r -= cum;
    if (shift == 0) { *kth = low + d; *ties_rank = r; return 0; }
    int64_t w = 0;
    uint32_t kmin = 0xffffffffu, kmax = 0;
    for (int64_t i = 0; i < m; ++i) {
        const uint32_t u = (src[i * step] & mask) - low;
        if ((u >> shift) == d) {
            keys[w++] = u;
            kmin = u < kmin ? u : kmin;
            kmax = u > kmax ? u : kmax;
        }
    }
    /* one value left (the second stage of alltoall samples ~99 % exact zeros: 120 us a sample
       through every digit, against ~25 us for spread values): that value, with its rank among the ties */
    if (kmin == kmax) { *kth = low + kmin; *ties_rank = r; return 0; }
    keys_kth(keys, w, r, shift - 10, 10, kth, ties_rank);  /* the keys below the digit, relative to low */
    *kth += low;
    return 0;
}
int ac_rth_largest_strided(const float* a, int64_t m, int64_t step, int64_t r, uint32_t* keys,
                           uint32_t* out, int absval) {
    int64_t ties;
    return radix_kth((const uint32_t*)a, step, absval ? 0x7fffffffu : 0xffffffffu, m, r, keys, out, &ties);
}
/* The elements of x[0 .. n) with |x| >= lo (pattern, sign cleared; lo >= 1), ascending: their bit
   patterns, sign included, into raw and positions into pos while at most cap pass; returns how many
   passed (cap + 1 once more would). */
#if defined(AC_AVX2)
/* chunk_at_least's blocks of 64 with AVX2 (one mask per block: the loop over a block's passing
   elements, whose exit the branch predictor misses, runs a quarter as often); from 0, returns the
   next i and the count so far in *count (stops once more than cap passed). */
__attribute__((target("avx2"))) static int64_t chunk_at_least_avx2(const uint32_t* u, int64_t n, uint32_t lo,
                                                                   int64_t cap, uint32_t* raw, int32_t* pos,
                                                                   int64_t* count) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), below = _mm256_set1_epi32((int)(lo - 1u));
    int64_t c = 0, i = 0;
    for (; i + 64 <= n && c <= cap; i += 64) {
        uint64_t msk = 0;
        for (int q = 0; q < 8; ++q) {
            const __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(u + i + 8 * q)), absm);
            msk |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, below)))
                   << (8 * q);
        }
        {
            int32_t* idx = pos;  /* AC_EMIT64's names */
            uint32_t* vals = raw;
            AC_EMIT64(msk, (int32_t)i, u[i + j])
        }
    }
    *count = c;
    return i;
}
/* Chunk-Top-k's compensation and candidate scan of one chunk in a single pass: a = g + r (one IEEE add
   per element, torch.add's bits; streamed where `stream`: a is read back only at the kept positions)
   and, from the sums in registers, what chunk_at_least would find in a (the same candidates, order and
   count). The compare-and-emit work overlaps the add's memory traffic instead of following it: on
   2^25 floats in 4096-element chunks the fused compensation and selection took 22 ms against 12 ms for
   the selection alone and 7 ms for the add alone (cost_notes item 39). */
/* With owed subtractions (np positions pp, ascending, relative to this chunk, and their values pv;
   a chunk of at most OWE_MAX elements): r is read as r - pv there (the residual ac_sub_at would
   have written, never written). */
#define OWE_MAX 4096
__attribute__((target("avx2"))) static int64_t chunk_add_at_least_avx2(const float* g, const float* r, float* a,
                                                                       int64_t n, uint32_t lo, int64_t cap,
                                                                       uint32_t* raw, int32_t* pos, int stream,
                                                                       const int64_t* pp, const float* pv,
                                                                       int64_t np) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), below = _mm256_set1_epi32((int)(lo - 1u));
    uint32_t blk[64] __attribute__((aligned(32)));
    /* the owed values laid out at their offsets and one bit per owed element, so the block loop
       blends them in without a branch (a test per position and per vector mispredicted: ~10 ns a
       position, as much as the write miss of ac_sub_at it replaces) */
    float owe[OWE_MAX] __attribute__((aligned(32)));
    uint64_t owes[OWE_MAX / 64];
    const int owing = np > 0 && n <= OWE_MAX;
    if (owing) {
        for (int64_t w = 0; w < (n + 63) / 64; ++w) owes[w] = 0;
        for (int64_t t = 0; t < np; ++t) {
            owes[pp[t] >> 6] |= (uint64_t)1 << (pp[t] & 63);
            owe[pp[t]] = pv[t];
        }
    }
    int64_t c = 0, i = 0, pj = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t msk = 0;
        const uint64_t owed = owing ? owes[i >> 6] : 0;
        AC_AHEAD(g, i, 4);
        AC_AHEAD(r, i, 4);
        for (int q = 0; q < 8; ++q) {
            __m256 rv = _mm256_loadu_ps(r + i + 8 * q);
            if (owing)  /* the same for the whole chunk: predicted */
                rv = _mm256_blendv_ps(rv, _mm256_sub_ps(rv, _mm256_load_ps(owe + i + 8 * q)),
                                      lanes_of((unsigned)(owed >> (8 * q)) & 0xffu));
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i + 8 * q), rv);
            if (stream) _mm256_stream_ps(a + i + 8 * q, v); else _mm256_storeu_ps(a + i + 8 * q, v);
            const __m256i b = _mm256_castps_si256(v);
            _mm256_store_si256((__m256i*)(blk + 8 * q), b);
            msk |= (uint64_t)(unsigned)_mm256_movemask_ps(
                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_and_si256(b, absm), below))) << (8 * q);
        }
        if (c <= cap) {  /* chunk_at_least stops emitting here: past cap the count is all that matters */
            int32_t* idx = pos;  /* AC_EMIT64's names */
            uint32_t* vals = raw;
            AC_EMIT64(msk, (int32_t)i, blk[j])
        }
    }
    if (stream) _mm_sfence();
    while (pj < np && pp[pj] < i) ++pj;
    for (; i < n; ++i) {
        const int now = pj < np && pp[pj] == i;
        const float v = g[i] + (now ? r[i] - pv[pj] : r[i]);
        pj += now;
        uint32_t b;
        a[i] = v;
        __builtin_memcpy(&b, &v, sizeof b);
        if (c <= cap && (b & 0x7fffffffu) >= lo) { if (c < cap) { raw[c] = b; pos[c] = (int32_t)i; } ++c; }
    }
    return c > cap ? cap + 1 : c;
}
#endif
static int64_t chunk_at_least(const uint32_t* u, int64_t n, uint32_t lo, int64_t cap, uint32_t* raw, int32_t* pos) {
    int64_t c = 0, i = 0;
    AVX2_FIRST(i = chunk_at_least_avx2(u, n, lo, cap, raw, pos, &c))
#if defined(__SSE2__)
    const __m128i absm = _mm_set1_epi32(0x7fffffff), below = _mm_set1_epi32((int)(lo - 1u));
    for (; i + 16 <= n && c <= cap; i += 16) {
        unsigned msk = 0;
        for (int q = 0; q < 4; ++q) {
            const __m128i v = _mm_and_si128(_mm_loadu_si128((const __m128i*)(u + i + 4 * q)), absm);
            msk |= (unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(v, below))) << (4 * q);
        }
        while (msk) {
            const int j = __builtin_ctz(msk);
            msk &= msk - 1;
            if (c < cap) { raw[c] = u[i + j]; pos[c] = (int32_t)(i + j); }
            ++c;
        }
    }
#endif
    for (; i < n && c <= cap; ++i) {
        if ((u[i] & 0x7fffffffu) >= lo) { if (c < cap) { raw[c] = u[i]; pos[c] = (int32_t)i; } ++c; }
    }
    return c > cap ? cap + 1 : c;
}
/* Chunk-Top-k's canonical selection: for each of `rows` runs of `chunk` floats, the k largest
   |a| at ascending positions, ties at the k-th magnitude to the lowest positions (the same set
   and order as adacomp.compressors.chunktopk's torch path). Writes k positions (0 .. chunk - 1)
   and the signed values per row. Neighbouring chunks of a tensor have similar magnitudes, so a
   floor below the previous chunk's k-th magnitude (scaled by f, which adapts) usually passes
   between k and cap = 4 k + 64 elements: then the k-th is found among those alone (every element
   at or above it passed); else the chunk is scanned again at a better floor (chunk_refloor), and
   over the whole chunk only where that fails too. A zero k-th (a dead unit's chunk) leaves the
   floor as it was. hint (rows uint32, or NULL): each row's k-th of the tensor's previous call (0:
   unknown, 1: it was zero), overwritten with this call's. A row's scale changes less from step to
   step than from row to row (a layer's units differ, a dead unit's row is dead again), so a hinted
   row's floor is its own last k-th, times the drift the hinted rows before it showed (grow: error
   feedback's residual still growing; smoothed over rows) and its own factor fh. Only the speed
   depends on the floors. keys: chunk + 2 cap uint32 of scratch.
   -1 on a NaN (torch answers). */
/* r's owed subtractions (positions pp, ascending, from *pj on, values pv) within [lo, hi) of the
   sum a = g + r just written: a = g + (r - pv) there (ac_sub_at's residual, then the add) */
static void chunk_owed_fix(float* a, const float* g, const float* r, int64_t lo, int64_t hi, const int64_t* pp,
                           const float* pv, int64_t np, int64_t* pj) {
    for (; *pj < np && pp[*pj] < hi; ++*pj) {
        const int64_t e = pp[*pj];
        if (e >= lo) a[e - lo] = g[e] + (r[e] - pv[*pj]);
    }
}
/* A chunk whose guessed floor passed too many candidates (c > cap: the first cap, in order, are in
   craw / cpos) or too few (c < k) is scanned again, from the caches, at a better floor, at most
   REFLOOR_TRIES times, before the whole chunk's radix select (~8x a candidate selection) answers:
   too many: the k-th largest of the first cap candidates (at least k of the chunk's magnitudes reach
   it, so the rescan passes k or more); too few: half the floor, or any nonzero magnitude (bit
   pattern >= 1) where none passed. On the models' own gradients the floor from the neighbouring
   chunk missed on 20-80 % of the chunks (rows of different scales, dead units' zero rows; on iid
   values on 1 %). Returns the count at the final floor *flo (c > cap: the first cap in craw /
   cpos; *flo == 1 and c < k: every nonzero one, so the k-th magnitude is 0). keys: scratch. */
#define REFLOOR_TRIES 4
/* The r-th largest magnitude (and its rank among the ties) of the m candidates craw (bit patterns,
   sign included), all at or above the floor `flo`, into keys; -1 on a NaN among them. They share the
   bits above the highest bit where flo and their largest differ: the first radix digit starts there
   (the exponent digit would put nearly all of them in one bucket and cost a pass). */
#if defined(AC_AVX2)
/* The kept candidates written in order where every key at the k-th magnitude is kept (no partial
   ties): the positions (int64) and values of the keys >= kth, 8 candidates a step compacted by a
   permutation; vectors only while 8 slots are left, the rest by the scalar rule. Returns how many
   it wrote (k). */
__attribute__((target("avx2,popcnt"))) static int64_t kept_write_avx2(const uint32_t* craw,
                                                                     const int32_t* cpos, int64_t c, uint32_t kth,
                                                                     int64_t k, int64_t* p, float* o) {
    const __m256i below = _mm256_set1_epi32((int)kth - 1);  /* magnitudes < 2^31: signed compares */
    const __m256i mag = _mm256_set1_epi32(0x7fffffff);
    int64_t w = 0, t = 0;
    for (; t + 8 <= c && w + 8 <= k; t += 8) {
        const __m256i kv = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(craw + t)), mag);
        const unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(kv, below)));
        const __m256i perm = compact_perm(ac_compact_lanes, mask);
        const __m256i pv = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(cpos + t)), perm);
        _mm256_storeu_si256((__m256i*)(p + w), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(pv)));
        _mm256_storeu_si256((__m256i*)(p + w + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(pv, 1)));
        _mm256_storeu_si256((__m256i*)(o + w),
                            _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(craw + t)), perm));
        w += __builtin_popcount(mask);
    }
    for (; t < c && w < k; ++t)
        if ((craw[t] & 0x7fffffffu) >= kth) {
            p[w] = cpos[t];
            __builtin_memcpy(o + w, craw + t, sizeof(float));
            ++w;
        }
    return w;
}
#endif
static int candidates_kth(const uint32_t* craw, int64_t m, int64_t r, uint32_t flo, uint32_t* keys, uint32_t* kth,
                          int64_t* ties) {
#if defined(AC_AVX2)
    if (use_avx2()) {
        int64_t reach;
        return kth_avx2(craw, 0x7fffffffu, m, r, keys, kth, ties, &reach);
    }
#endif
    uint32_t top = 0;
    for (int64_t t = 0; t < m; ++t) {
        keys[t] = craw[t] & 0x7fffffffu;
        top = keys[t] > top ? keys[t] : top;
    }
    if (top > 0x7f800000u) return -1;  /* a NaN */
    const int high = top > flo ? 31 - __builtin_clz(top ^ flo) : 30;
    keys_kth(keys, m, r, high - 7, 8, kth, ties);
    return 0;
}
static int64_t chunk_refloor(const uint32_t* u, int64_t chunk, int64_t k, int64_t cap, uint32_t* keys,
                             uint32_t* craw, int32_t* cpos, int64_t c, uint32_t* flo) {
    for (int t = 0; t < REFLOOR_TRIES && (c > cap || c < k); ++t) {
        uint32_t next;
        if (c > cap) {
            int64_t ties;
            if (candidates_kth(craw, cap, k, *flo, keys, &next, &ties) != 0) return c;  /* a NaN: the whole
                                                                                      chunk's path reports it */
            if (next <= *flo) return c;  /* ties at the floor: no higher floor passes k */
        } else {
            if (*flo <= 1) return c;  /* fewer than k nonzero: the caller's zero k-th */
            float h;
            __builtin_memcpy(&h, flo, sizeof h);
            h *= 0.5f;
            __builtin_memcpy(&next, &h, sizeof next);
            if (c == 0 || next < 0x00800000u) next = 1;  /* none passed, or subnormal: any nonzero */
        }
        *flo = next;
        c = chunk_at_least(u, chunk, next, cap, craw, cpos);
    }
    return c;
}
static int chunk_topk_rows(float* a, int64_t rows, int64_t chunk, int64_t k, uint32_t* keys, int64_t* pos,
                           float* vals, const float* g, const float* plus, const int64_t* pp, const float* pv,
                           int64_t np, uint32_t* hint, int64_t* done, int64_t* pj) {
    const int64_t cap = 4 * k + 64;
    const int guessing = 2 * cap <= chunk;
    uint32_t* craw = keys + chunk;  /* the candidates' bit patterns, sign included */
    int32_t* cpos = (int32_t*)(keys + chunk + cap);
    uint32_t lo = 0;
    float fn = 0.875f, fh = 0.875f;  /* the floors' factors on the neighbour's k-th and on the row's own */
    float grow = 1.0f;  /* the last hinted row's k-th over its previous one: the scale's drift since */
#if defined(AC_AVX2)
    const int fuse = g != NULL && use_avx2();
    const int stream = rows * chunk >= AC_SELECT_STREAM_MIN && chunk % 8 == 0 && ((uintptr_t)a & 31) == 0;
#endif
    for (int64_t row = 0; row < rows; ++row) {
        float* x = a + row * chunk;
        /* the floor: this row's k-th of the previous call where known, else the neighbour's */
        uint32_t lo_row = lo;
        const int hinted = hint != NULL && hint[row] > 0;
        if (hinted) {  /* 1: a zero k-th, so any nonzero magnitude is a candidate */
            float h;
            __builtin_memcpy(&h, hint + row, sizeof h);
            h *= hint[row] > 1 ? grow * fh : 1.0f;
            __builtin_memcpy(&lo_row, &h, sizeof lo_row);
            lo_row = lo_row > 0 ? lo_row : 1;
        }
        const int guess = guessing && lo_row > 0;
        int64_t c = 0;
#if defined(AC_AVX2)
        if (fuse && guess) {
            const int64_t p0 = *pj, base = row * chunk;
            while (*pj < np && pp[*pj] < base + chunk) ++*pj;
            /* this chunk's owed positions, made relative to it (a few dozen: a small copy) */
            int64_t rel[512];
            const int64_t cnt = *pj - p0;
            if (cnt <= 512 && (cnt == 0 || chunk <= OWE_MAX)) {
                for (int64_t t = 0; t < cnt; ++t) rel[t] = pp[p0 + t] - base;
                c = chunk_add_at_least_avx2(g + base, plus + base, x, chunk, lo_row, cap, craw, cpos, stream, rel,
                                            pv + p0, cnt);
            } else {
                c = chunk_add_at_least_avx2(g + base, plus + base, x, chunk, lo_row, cap, craw, cpos, stream, NULL,
                                            NULL, 0);
                *pj = p0;
                chunk_owed_fix(x, g, plus, base, base + chunk, pp, pv, np, pj);
                c = chunk_at_least((const uint32_t*)x, chunk, lo_row, cap, craw, cpos);  /* the fixed sums' candidates */
            }
        } else
#endif
        {
            if (g != NULL) {  /* error feedback's compensation (one IEEE add), the chunk left in cache */
                for (int64_t j = 0; j < chunk; ++j) x[j] = g[row * chunk + j] + plus[row * chunk + j];
                chunk_owed_fix(x, g, plus, row * chunk, (row + 1) * chunk, pp, pv, np, pj);
            }
            if (guess) c = chunk_at_least((const uint32_t*)x, chunk, lo_row, cap, craw, cpos);
        }
        *done = row + 1;
        const uint32_t* u = (const uint32_t*)x;
        int64_t* p = pos + row * k;
        float* o = vals + row * k;
        uint32_t kth, flo = lo_row;
        int64_t ties, w = 0;
        const int64_t c0 = c;
        if (guess) c = chunk_refloor(u, chunk, k, cap, keys, craw, cpos, c, &flo);
        int64_t reach = -1;  /* (AVX2) how many candidates reach the k-th: k when no tie is cut */
#if defined(AC_AVX2)
        if (c >= k && c <= cap && use_avx2()) {
            if (kth_avx2(craw, 0x7fffffffu, c, k, keys, &kth, &ties, &reach) != 0) return -1;  /* a NaN */
            if (reach == k) w = kept_write_avx2(craw, cpos, c, kth, k, p, o);
        }
#endif
        if (w == k) {
            /* the vector writing kept them all */
        } else if (c >= k && c <= cap) {
            if (reach < 0 && candidates_kth(craw, c, k, flo, keys, &kth, &ties) != 0) return -1;  /* a NaN */
            for (int64_t t = 0; t < c && w < k; ++t) {  /* branch-free: every candidate is written, */
                const uint32_t b = craw[t], v = b & 0x7fffffffu;  /* the kept ones advance w */
                const int64_t eq = v == kth;
                p[w] = cpos[t];
                __builtin_memcpy(o + w, &b, sizeof b);  /* x[cpos[t]]'s bits, from the candidate */
                w += (v > kth) | (eq & (ties > 0));
                ties -= eq;
            }
        } else {
            if (flo == 1 && c < k) {  /* fewer than k nonzero magnitudes (a dead unit's chunk): the */
                for (int64_t t = 0; t < c; ++t)  /* k-th is 0, the zeros from the lowest positions */
                    if ((craw[t] & 0x7fffffffu) > 0x7f800000u) return -1;  /* a NaN */
                kth = 0;
                ties = k - c;
            } else if (radix_kth(u, 1, 0x7fffffffu, chunk, k, keys, &kth, &ties) != 0) {
                return -1;  /* a NaN */
            }
            for (int64_t i = 0; i < chunk && w < k; ++i) {
                const uint32_t v = u[i] & 0x7fffffffu;
                if (v > kth || (v == kth && ties-- > 0)) { p[w] = i; o[w] = x[i]; ++w; }
            }
        }
        if (guessing) {  /* the next chunk's floor */
            float* f = hinted ? &fh : &fn;  /* each factor learns from its own floors' misses */
            if (c0 > cap) *f = 0.5f * (1.0f + *f);
            else if (c0 < k && lo_row > 1) *f *= 0.75f;
            float g;
            uint32_t b = kth;
            __builtin_memcpy(&g, &b, sizeof g);
            g *= fn;
            __builtin_memcpy(&b, &g, sizeof b);
            /* a zero k-th (a dead unit's chunk) keeps the floor: the next live chunk guesses from it */
            lo = kth >= 0x7f000000u ? 0 : b > 0 ? b : lo;
        }
        if (hint != NULL) {
            if (hinted && hint[row] > 1 && kth > 0 && kth < 0x7f000000u) {
                float now, was;
                __builtin_memcpy(&now, &kth, sizeof now);
                __builtin_memcpy(&was, hint + row, sizeof was);
                grow = __builtin_sqrtf(grow * (now / was));  /* smoothed: one row's drift is noisy */
                grow = grow < 0x1p-8f ? 0x1p-8f : grow > 0x1p8f ? 0x1p8f : grow;
            }
            hint[row] = kth >= 0x7f000000u ? 0 : kth > 0 ? kth : 1;  /* the next call's floor */
        }
    }
    return 0;
}
/* Per run of `chunk` elements (rows of them) of a: the k largest |x|, ascending positions, ties at the
   k-th magnitude to the lowest positions (Chunk-Top-k). g not NULL: first a = g + plus, each chunk
   just before it is read (the compensation's pass and the selection's in one); the sum is written
   whole even where a NaN stops the selection (-1: torch's path answers). */
int ac_chunk_topk(float* a, int64_t rows, int64_t chunk, int64_t k, uint32_t* keys, int64_t* pos, float* vals,
                  const float* g, const float* plus, const int64_t* pp, const float* pv, int64_t np, uint32_t* hint) {
    int64_t done = 0, pj = 0;
    const int rc = chunk_topk_rows(a, rows, chunk, k, keys, pos, vals, g, plus, pp, pv, np, hint, &done, &pj);
    if (g != NULL) {
        for (int64_t i = done * chunk; i < rows * chunk; ++i) a[i] = g[i] + plus[i];
        chunk_owed_fix(a + done * chunk, g, plus, done * chunk, rows * chunk, pp, pv, np, &pj);
    }
    return rc;
}
/* ADTopk's per-row floor: out[i] = the r-th largest (1-based) of row i of the (rows, b) float32 matrix
   a, whose values are magnitudes (>= 0; a zero's sign is ignored), or NaN where the row holds a NaN:
   torch.topk(a, r, dim=1).values.amin(1) (torch ranks NaN first, and amin of a NaN is NaN). A
   quickselect on the bit patterns (non-negative floats order as them) in `keys` (b of scratch). */
#if defined(AC_AVX2)
/* The r-th largest of b <= ROW_KTH_RANKED keys (< 2^31, so signed compares order them; room for b + 8:
   whole vectors are read, the lanes past b ignored) without branches, for each of nr ranks r[t] (1 <=
   r[t] <= b) into out[t]: the largest key that at least r keys reach. b^2 / 8 compares for all ranks
   together instead of a quickselect's mispredicted partition loop per rank (~35 cycles a key on rows of
   32-64; at 256 keys the quadratic count loses). */
#define ROW_KTH_RANKED 128
__attribute__((target("avx2"), always_inline)) static inline void ranked_avx2(const uint32_t* keys, int64_t b,
                                                                              const int64_t* r, int nr,
                                                                              uint32_t* out) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i best[3];
    for (int t = 0; t < nr; ++t) best[t] = _mm256_setzero_si256();
    for (int64_t j = 0; j < b; j += 8) {
        const __m256i kj = _mm256_loadu_si256((const __m256i*)(keys + j));
        __m256i reach = _mm256_set1_epi32((int)b);  /* b - #(keys below it) = #(keys >= it) */
        for (int64_t i = 0; i < b; ++i)
            reach = _mm256_add_epi32(reach, _mm256_cmpgt_epi32(kj, _mm256_set1_epi32((int)keys[i])));
        const __m256i live = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(b - j)), lane), kj);
        for (int t = 0; t < nr; ++t)
            best[t] = _mm256_max_epi32(best[t], _mm256_and_si256(
                                                    _mm256_cmpgt_epi32(reach, _mm256_set1_epi32((int)r[t] - 1)), live));
    }
    for (int t = 0; t < nr; ++t) {
        uint32_t v[8], m = 0;
        _mm256_storeu_si256((__m256i*)v, best[t]);
        for (int l = 0; l < 8; ++l) m = v[l] > m ? v[l] : m;
        out[t] = m;
    }
}
__attribute__((target("avx2"))) static uint32_t row_kth_ranked_avx2(const uint32_t* keys, int64_t b, int64_t r) {
    uint32_t m;
    ranked_avx2(keys, b, &r, 1, &m);
    return m;
}
/* ac_row_order_stats's three ranks of one row's b <= ROW_KTH_RANKED keys from one rank count: out[j] =
   the (q + 2 - j)-th largest as float bits where 1 <= q + 2 - j <= b (else left alone). Rows of ~1.6 q
   candidates: three quickselects cost ~440 cycles a row there, their branches mispredicted (cost_notes
   item 40). */
__attribute__((target("avx2"))) static void row_kth3_ranked_avx2(const uint32_t* keys, int64_t b, int64_t q,
                                                                  float* out) {
    int64_t r[3];
    int at[3], nr = 0;
    for (int t = 0; t < 3; ++t)
        if (q + 2 - t >= 1 && q + 2 - t <= b) { r[nr] = q + 2 - t; at[nr++] = t; }
    uint32_t got[3];
    ranked_avx2(keys, b, r, nr, got);
    for (int t = 0; t < nr; ++t) __builtin_memcpy(out + at[t], got + t, sizeof got[t]);
}
#endif
/* the r-th largest of b keys (each < 2^31; keys is reordered), by the rank count where padded (room
   for b + 8) is given, else by a quickselect */
static uint32_t kth_of_keys(uint32_t* keys, int64_t b, int64_t r, uint32_t* padded) {
#if defined(AC_AVX2)
    if (padded) {
        __builtin_memcpy(padded, keys, (size_t)b * sizeof *keys);
        return row_kth_ranked_avx2(padded, b, r);
    }
#else
    (void)padded;
#endif
    int64_t lo = 0, hi = b - 1;
    const int64_t want = r - 1;  /* position in descending order */
    while (lo < hi) {
        const uint32_t pivot = keys[lo + (hi - lo) / 2];
        int64_t x = lo, y = hi;
        while (x <= y) {
            while (keys[x] > pivot) ++x;
            while (keys[y] < pivot) --y;
            if (x <= y) { const uint32_t t = keys[x]; keys[x] = keys[y]; keys[y] = t; ++x; --y; }
        }
        if (want <= y) hi = y;
        else if (want >= x) lo = x;
        else break;
    }
    return keys[want];
}
#if defined(AC_AVX2)
#define RANKED_SCRATCH(b) uint32_t padded_[ROW_KTH_RANKED + 8]; \
    uint32_t* const padded = use_avx2() && (b) <= ROW_KTH_RANKED ? padded_ : NULL;
#else
#define RANKED_SCRATCH(b) uint32_t* const padded = NULL;
#endif
void ac_row_kth(const float* a, int64_t rows, int64_t b, int64_t r, uint32_t* keys, float* out) {
    RANKED_SCRATCH(b)
    for (int64_t i = 0; i < rows; ++i) {
        const uint32_t* u = (const uint32_t*)(a + i * b);
        int nan = 0;
        for (int64_t j = 0; j < b; ++j) {
            keys[j] = u[j] & 0x7fffffffu;
            nan |= keys[j] > 0x7f800000u;
        }
        if (nan) { out[i] = __builtin_nanf(""); continue; }
        const uint32_t kth = kth_of_keys(keys, b, r, padded);
        __builtin_memcpy(out + i, &kth, sizeof kth);
    }
}
/* ADTopk's order statistics of each row's candidates (mag[], grouped by row: row[] non-decreasing),
   instead of an integer sort of them all: out[3 i + j] = the (q + 2 - j)-th largest magnitude of row i
   where it has that many candidates, else -1 (j = 0, 1, 2: v[q+1], v[q], v[q-1], 0-based descending),
   ranked by the magnitudes' bits as that sort ranks them (a NaN above inf). keys: room for the longest
   row. Also each row's candidate count (counts[i], torch.bincount's) and whether one is a NaN (nan[i]).
   Returns -1 where the rows are not grouped (the caller sorts). */
int ac_row_order_stats(const float* mag, const int64_t* row, int64_t nc, int64_t m, int64_t q, uint32_t* keys,
                       float* out, int64_t* counts, uint8_t* nan) {
    for (int64_t i = 0; i < 3 * m; ++i) out[i] = -1.0f;
    for (int64_t i = 0; i < m; ++i) { counts[i] = 0; nan[i] = 0; }
    for (int64_t s = 0, e; s < nc; s = e) {
        const int64_t r0 = row[s];
        if (r0 < 0 || r0 >= m) return -1;
        for (e = s + 1; e < nc && row[e] == r0; ++e) {}
        if (e < nc && row[e] < r0) return -1;
        const int64_t len = e - s;
        uint32_t top = 0;
        for (int64_t t = 0; t < len; ++t) {
            uint32_t u;
            __builtin_memcpy(&u, mag + s + t, sizeof u);
            keys[t] = u & 0x7fffffffu;
            top = keys[t] > top ? keys[t] : top;
        }
        counts[r0] = len;
        nan[r0] = top > 0x7f800000u;
#if defined(AC_AVX2)
        if (len <= ROW_KTH_RANKED && use_avx2()) {  /* keys has room for len + 8 */
            row_kth3_ranked_avx2(keys, len, q, out + 3 * r0);
            continue;
        }
#endif
        /* the largest rank the row has, then the next two from one more pass: a radix select over the
           row's bits (three quickselects cost ~5 us a row of ~350 candidates, one radix select and
           the pass ~1.5: VGG-16's fc6, 4096 rows a step); a NaN row takes a quickselect, which
           leaves that many largest keys in front, and the next ranks from the smallest of those */
        int j0 = 0;
        while (j0 < 3 && !(q + 2 - j0 >= 1 && len >= q + 2 - j0)) ++j0;
        if (j0 == 3) continue;
        const int64_t front = q + 2 - j0;
        uint32_t low[3] = {0, 0xffffffffu, 0xffffffffu};
        const uint32_t* src = (const uint32_t*)(mag + s);
        int64_t ties;
        if (!nan[r0] && radix_kth(src, 1, 0x7fffffffu, len, front, keys, &low[0], &ties) == 0) {
            /* rank front - d is low[0] while keys equal to it fill that slot, else one of the two
               smallest keys above it */
            int64_t above = 0;
            uint32_t a = 0xffffffffu, b = 0xffffffffu;
            for (int64_t t = 0; t < len; ++t) {
                const uint32_t v = src[t] & 0x7fffffffu;
                if (v > low[0]) {
                    ++above;
                    if (v < a) { b = a; a = v; }
                    else if (v < b) b = v;
                }
            }
            for (int d = 1; d < 3; ++d) {
                const int64_t rr = front - d;
                low[d] = rr > above ? low[0] : (above - rr == 0 ? a : b);
            }
        } else {
            low[0] = kth_of_keys(keys, len, front, NULL);
            int skipped = 0;  /* the two smallest of the front without one copy of the first */
            for (int64_t t = 0; t < front; ++t) {
                const uint32_t k = keys[t];
                if (!skipped && k == low[0]) { skipped = 1; continue; }
                if (k < low[1]) { low[2] = low[1]; low[1] = k; }
                else if (k < low[2]) low[2] = k;
            }
        }
        for (int j = j0; j < 3; ++j) {
            const int64_t rank = q + 2 - j;
            if (rank < 1) break;
            __builtin_memcpy(out + 3 * r0 + j, &low[j - j0], sizeof(uint32_t));
        }
    }
    return 0;
}
/* ADTopk's last pass over the candidates (ascending positions flat[], their magnitudes mag[] and rows
   row[] < m): the positions whose row is chosen and whose magnitude reaches the row's threshold, in
   their order, bitwise torch's flat[chose[row] & (mag >= thr[row])]; every candidate is written at
   the count, which only the kept ones advance (no branch per candidate). Returns the count, -1 on a
   row out of range (nothing to trust: the caller's torch path answers). */
int64_t ac_row_chosen(const float* mag, const int64_t* flat, const int64_t* row, int64_t nc, int64_t m,
                      const float* thr, const uint8_t* chose, int64_t* out) {
    int64_t w = 0;
    for (int64_t i = 0; i < nc; ++i) {
        const int64_t r = row[i];
        if (r < 0 || r >= m) return -1;
        out[w] = flat[i];
        w += (chose[r] != 0) & (mag[i] >= thr[r]);
    }
    return w;
}
/* ADTopk's whole selection from one tensor's candidates (ascending positions flat[] in an (m, n)
   matrix, their values vals[], magnitudes or, with signed_vals, the signed values): each row's
   v[q+1], v[q], v[q-1] (ac_row_order_stats); the r rows with the largest v[q] take q + 1; each row's
   candidates reaching its threshold (v[q] in those rows, v[q-1] in the others), in their order (as
   ac_row_chosen), with their values where out_vals is given (signed: the payload's, no gather from
   the tensor). It was ~30 small torch calls per tensor in Python (100-400 us each, ~50 tensors of
   ResNet-50) and a gather. Returns the count, or:
   -1  a position out of range or not ascending;
   -2  a row torch.topk must answer: bad_in 1, a NaN, fewer than q + 1 candidates (or, without
       tied_out, a tie at a row's cut): the caller's general path runs;
   -3  a tie at the r-th largest v[q]: the caller calls again with torch.topk's choice of the rows
       taking q + 1 in extra_in (1 where a row does).
   With tied_out, a row tied at its cut is left out and flagged there (1: it takes q, 2: q + 1;
   *ntied counts them) for the caller's torch.topk. An all-zero row (bad_in 2, a dead unit's) takes
   zero_cols (torch.topk's columns on a row of equal values: the first q ascending, then the q + 1 of
   a row taking one more) with x's values there. keys: max(m, n) + 8 uint32; rows nc int64 (written:
   each candidate's row); stats 3m floats; counts m; nan, thr m. */
int64_t ac_row_finish(const float* vals, const int64_t* flat, int64_t nc, int64_t m, int64_t n, int64_t q,
                      int64_t r, int signed_vals, const uint8_t* bad_in, uint32_t* keys, int64_t* rows,
                      float* stats, int64_t* counts, uint8_t* nan, float* thr, int64_t* out, float* out_vals,
                      const float* x, const int64_t* zero_cols, const uint8_t* extra_in, uint8_t* tied_out,
                      int64_t* ntied) {
    if (q < 1 || r < 0 || r >= m || n < 1) return -1;
    if (ntied) *ntied = 0;
    for (int64_t i = 0, row = 0; i < nc; ++i) {
        if (flat[i] < 0 || flat[i] >= m * n || (i > 0 && flat[i] <= flat[i - 1])) return -1;
        while (flat[i] >= (row + 1) * n) ++row;
        rows[i] = row;
    }
    /* the ranks read magnitude bits (the sign bit masked): signed values serve as they are */
    if (ac_row_order_stats(vals, rows, nc, m, q, keys, stats, counts, nan) != 0) return -1;
    for (int64_t i = 0; i < m; ++i) {
        if (bad_in[i] == 2 && zero_cols != NULL && x != NULL && counts[i] == 0) {
            stats[3 * i] = stats[3 * i + 1] = stats[3 * i + 2] = 0.0f;  /* its ranks are all +-0 */
            continue;
        }
        if (bad_in[i] | nan[i] | (counts[i] < q + 1)) return -2;
    }
    /* every v[q] is a candidate's magnitude (> 0, not NaN): its bits order as the floats do */
    uint32_t cut = 0;
    if (r > 0 && extra_in == NULL) {
        for (int64_t i = 0; i < m; ++i) __builtin_memcpy(keys + i, stats + 3 * i + 1, sizeof *keys);
        cut = kth_of_keys(keys, m, r, NULL);
        int64_t above = 0;
        for (int64_t i = 0; i < m; ++i) {
            uint32_t u;
            __builtin_memcpy(&u, stats + 3 * i + 1, sizeof u);
            above += u >= cut;
        }
        if (above != r) return -3;  /* torch.topk's choice among the tied rows: given back as extra_in */
    }
    for (int64_t i = 0; i < m; ++i) {
        const float* s = stats + 3 * i;  /* v[q+1] (-1 where the row has q + 1), v[q], v[q-1] */
        uint32_t u;
        __builtin_memcpy(&u, s + 1, sizeof u);
        const int extra = r > 0 && (extra_in != NULL ? extra_in[i] != 0 : u >= cut);
        thr[i] = (float)extra;  /* (an all-zero row's threshold is unused: it keeps whether it takes q + 1) */
        if (tied_out) tied_out[i] = 0;
        if (bad_in[i] == 2 && counts[i] == 0) continue;  /* an all-zero row: torch.topk's columns for it */
        if (extra ? s[1] <= s[0] : s[2] <= s[1]) {  /* a tie at the row's cut: torch.topk's choice */
            if (!tied_out) return -2;
            tied_out[i] = (uint8_t)(1 + extra);  /* the caller's torch.topk takes q (1) or q + 1 (2) */
            ++*ntied;
            thr[i] = __builtin_nanf("");  /* none of its candidates is emitted here */
            continue;
        }
        thr[i] = extra ? s[1] : s[2];
    }
    int64_t w = 0, at = 0;
    for (int64_t i = 0; i < m; ++i) {
        if (bad_in[i] == 2 && counts[i] == 0) {
            const int64_t take = thr[i] != 0.0f ? q + 1 : q;  /* extra: the q + 1 after the first q */
            const int64_t* cols = thr[i] != 0.0f ? zero_cols + q : zero_cols;
            for (int64_t j = 0; j < take; ++j) {
                out[w] = i * n + cols[j];
                if (out_vals) out_vals[w] = x[i * n + cols[j]];
                ++w;
            }
            continue;
        }
        for (; at < nc && rows[at] == i; ++at) {
            const float v = vals[at];
            out[w] = flat[at];
            if (out_vals) out_vals[w] = v;
            w += (signed_vals ? __builtin_fabsf(v) : v) >= thr[i];
        }
    }
    return w;
}
#if defined(AC_AVX2)
/* src to dst with non-temporal stores where dst is 32-byte aligned (plain stores around it) */
__attribute__((target("avx2"))) static void stream_run(float* dst, const float* src, int64_t n) {
    int64_t j = 0;
    for (; j < n && ((uintptr_t)(dst + j) & 31); ++j) dst[j] = src[j];
    for (; j + 8 <= n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
    for (; j < n; ++j) dst[j] = src[j];
}
__attribute__((target("avx2"))) static void stream_fence(void) { _mm_sfence(); }
/* One row of ADTopk's compensation in one pass: row = g + p (one IEEE add per element, torch.add's
   bits) into the L1 scratch row, streamed to dst (32-byte aligned), and the row's strided block maxima
   of the sums' magnitude bits into acc (block_max_keys of row; b a multiple of 8, n >= b): the add,
   the copy to dst and the block maxima were three passes over the row (cost_notes item 41). */
__attribute__((target("avx2"))) static void row_add_block_max_avx2(const float* g, const float* p, float* row,
                                                                    float* dst, int64_t n, int64_t b, uint32_t* acc) {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff);
    const int64_t bs = n / b;
    int64_t i = 0;
    for (int64_t c = 0; c < bs; ++c)
        for (int64_t j = 0; j < b; j += 8, i += 8) {
            if ((i & 15) == 0) { AC_AHEAD(g, i, 1); AC_AHEAD(p, i, 1); }
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(p + i));
            _mm256_storeu_ps(row + i, v);
            _mm256_stream_ps(dst + i, v);
            const __m256i k = _mm256_and_si256(_mm256_castps_si256(v), absm);
            __m256i* a = (__m256i*)(acc + j);
            _mm256_storeu_si256(a, c == 0 ? k : _mm256_max_epi32(_mm256_loadu_si256(a), k));
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(p + i));
        _mm256_storeu_ps(row + i, v);
        _mm256_stream_ps(dst + i, v);
    }
    for (; i < n; ++i) row[i] = dst[i] = g[i] + p[i];
}
#endif
/* ADTopk's candidates row by row while the row is in cache (rows of x, one read from memory): the
   strided block maxima of |x| (ac_row_block_max_abs), their r-th largest as the row's floor (at
   least tiny; infinity and bad[i] = 1 where a maximum is NaN), then the row's |x| >= floor
   (!(|x| < floor) where columns lie past the last whole block) as ascending flat indices and |x|
   (keys: b of scratch). Returns the count; only the first cap are written. With g, error feedback's
   compensation x = g + plus (one IEEE add) row by row first: on large tensors with AVX2 each row's
   sum is formed in an L1 scratch row, read from there and streamed to x (x's lines are never read
   first: one read of the tensor less than storing into it); else written into x. */
AC_CLONES int64_t ac_row_candidates(float* x, int64_t m, int64_t n, int64_t b, int64_t r, float tiny,
                                    uint32_t* keys, uint8_t* bad, int64_t* idx, float* vals, int64_t cap,
                                    const float* g, const float* plus, int signed_vals) {
    RANKED_SCRATCH(b)
    int64_t total = 0;
    float* row = NULL;
#if defined(AC_AVX2)
    if (g != NULL && m * n >= AC_SELECT_STREAM_MIN && use_avx2())
        row = (float*)malloc((size_t)n * sizeof(float));
#endif
    for (int64_t i = 0; i < m; ++i) {
        const float* src = x + i * n;
        int maxed = 0;  /* keys hold the block maxima already */
        if (g != NULL) {
#if defined(AC_AVX2)
            if (row != NULL && b % 8 == 0 && ((uintptr_t)(x + i * n) & 31) == 0) {
                row_add_block_max_avx2(g + i * n, plus + i * n, row, x + i * n, n, b, keys);
                src = row;
                maxed = 1;
            } else
#endif
            {
                float* sum = row != NULL ? row : x + i * n;
                for (int64_t j = 0; j < n; ++j) sum[j] = g[i * n + j] + plus[i * n + j];
#if defined(AC_AVX2)
                if (row != NULL) { stream_run(x + i * n, row, n); src = row; }
#endif
            }
        }
        if (!maxed) block_max_keys((const uint32_t*)src, n, b, keys);
        int nan = 0;
        uint32_t any = 0;
        for (int64_t j = 0; j < b; ++j) { nan |= keys[j] > 0x7f800000u; any |= keys[j]; }
        float t = __builtin_inff();
        /* 1: a NaN; 2: every element +-0 (the blocks cover the row: a dead unit's weight row) */
        bad[i] = (uint8_t)(nan ? 1 : any == 0 && n % b == 0 ? 2 : 0);
        if (!nan) {
            const uint32_t kth = kth_of_keys(keys, b, r, padded);
            __builtin_memcpy(&t, &kth, sizeof t);
            t = t < tiny ? tiny : t;
        }
        const int64_t at = total < cap ? total : cap;
        const int64_t c = (signed_vals ? (n % b == 0 ? ac_select_abs_ge_signed : ac_select_abs_not_lt_signed)
                                       : (n % b == 0 ? ac_select_abs_ge : ac_select_abs_not_lt))(
            src, n, t, idx + at, vals + at, cap - at);
        const int64_t w = c < cap - at ? c : cap - at;
        for (int64_t j = 0; j < w; ++j) idx[at + j] += i * n;
        total += c;
    }
#if defined(AC_AVX2)
    if (row != NULL) { stream_fence(); free(row); }
#endif
    return total;
}
/* Top-k's last step on a prefilter's candidates (adacomp.compressors.sparse.largest_k): of the m
   candidates at ascending positions cidx with values vals (signed, or magnitudes), the k largest
   |value|, ties at the k-th magnitude to the lowest positions, written as positions and the signed
   values: flat[position], or the candidate's own value when flat is NULL (signed candidates: no
   gather from the tensor). cidx NULL: the candidates are the whole tensor (position i). No mask,
   nonzero or gather pass. keys: m uint32 of scratch. -1 on a NaN (torch answers). */
#if defined(AC_AVX2)
/* ac_pick_largest's writing where no tie at the k-th is cut (every candidate >= kth is kept): 8
   candidates a step, compacted by permutations (positions as two halves of 64-bit lanes), while 8
   slots are left; values gathered from flat after the positions where flat is given. Returns how
   many it wrote; the caller's scalar loop finishes from candidate *next. */
__attribute__((target("avx2,popcnt"))) static int64_t pick_write_avx2(const float* vals, const int64_t* cidx,
                                                                     int64_t m, int64_t k, uint32_t kth,
                                                                     const float* flat, int64_t* out_idx,
                                                                     float* out_vals, int64_t* next) {
    const __m256i below = _mm256_set1_epi32((int)kth - 1), mag = _mm256_set1_epi32(0x7fffffff);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t w = 0, i = 0;
    for (; i + 8 <= m && w + 8 <= k; i += 8) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(vals + i));
        const unsigned bits = (unsigned)_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_and_si256(raw, mag), below)));
        if (!bits) continue;
        const int cnt = __builtin_popcount(bits);
        if (cidx != NULL) {
            const unsigned lo = bits & 15u;
            const __m256i a = _mm256_loadu_si256((const __m256i*)(cidx + i)), b = _mm256_loadu_si256((const __m256i*)(cidx + i + 4));
            _mm256_storeu_si256((__m256i*)(out_idx + w), _mm256_permutevar8x32_epi32(a, compact_perm(ac_compact_pairs, lo)));
            _mm256_storeu_si256((__m256i*)(out_idx + w + __builtin_popcount(lo)),
                                _mm256_permutevar8x32_epi32(b, compact_perm(ac_compact_pairs, bits >> 4)));
        } else {
            const __m256i at = _mm256_permutevar8x32_epi32(lane, compact_perm(ac_compact_lanes, bits));
            const __m256i base = _mm256_set1_epi64x(i);
            _mm256_storeu_si256((__m256i*)(out_idx + w), _mm256_add_epi64(base, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(at))));
            _mm256_storeu_si256((__m256i*)(out_idx + w + 4),
                                _mm256_add_epi64(base, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(at, 1))));
        }
        if (flat == NULL)
            _mm256_storeu_si256((__m256i*)(out_vals + w), _mm256_permutevar8x32_epi32(raw, compact_perm(ac_compact_lanes, bits)));
        else
            for (int j = 0; j < cnt; ++j) out_vals[w + j] = flat[out_idx[w + j]];
        w += cnt;
    }
    *next = i;
    return w;
}
#endif
int ac_pick_largest(const float* vals, const int64_t* cidx, int64_t m, int64_t k, const float* flat,
                    uint32_t* keys, int64_t* out_idx, float* out_vals) {
    uint32_t kth; int64_t ties;
    const uint32_t* u = (const uint32_t*)vals;
    int64_t w = 0, i0 = 0;
#if defined(AC_AVX2)
    if (k >= 1 && k <= m && use_avx2()) {
        int64_t reach;
        if (kth_avx2(u, 0x7fffffffu, m, k, keys, &kth, &ties, &reach) != 0) return -1;
        if (reach == k) {  /* no tie is cut: the rest keep every tie too */
            w = pick_write_avx2(vals, cidx, m, k, kth, flat, out_idx, out_vals, &i0);
            ties = k;
        }
    } else
#endif
    if (radix_kth(u, 1, 0x7fffffffu, m, k, keys, &kth, &ties) != 0) return -1;
    for (int64_t i = i0; i < m && w < k; ++i) {
        const uint32_t v = u[i] & 0x7fffffffu;
        if (v > kth || (v == kth && ties-- > 0)) {
            const int64_t at = cidx != NULL ? cidx[i] : i;
            out_idx[w] = at;
            out_vals[w] = flat != NULL ? flat[at] : vals[i];
            ++w;
        }
    }
    return 0;
}
/* ac_pick_largest over a whole tensor (cidx NULL) with few kept (k <= m / PICK_FILTER_RATIO): the
   radix select over all m keys (a histogram and a digit pass, scalar, then a selection loop: ~3.5 ns
   an element, 113 us on alltoall's 32K-element parts of ResNet-50) replaced by a floor from a strided
   sample of PICK_SAMPLE keys at about 3x the kept share, one vectorised pass keeping what passes it
   (!(|x| < floor): a NaN passes and is then seen by the select; a floor of +0 is raised to the least
   nonzero), and the select over those alone.
   Every element ranked at or above the k-th largest passes the floor once at least k do, so the
   positions, ties and values are ac_pick_largest's. Returns 1 when picked so; 0 when the floor kept
   fewer than k or more than cap (nothing written: the caller runs ac_pick_largest); -1 on a NaN.
   keys: 2 * cap uint32 of scratch (cap >= PICK_SAMPLE); cand: cap int64 of scratch. */
#define PICK_SAMPLE 512
int ac_pick_largest_filtered(const float* vals, int64_t m, int64_t k, const float* flat, uint32_t* keys,
                             int64_t* cand, int64_t cap, int64_t* out_idx, float* out_vals) {
    const uint32_t* u = (const uint32_t*)vals;
    uint32_t samp[PICK_SAMPLE], floor_key;
    int64_t ties;
    if (m < PICK_SAMPLE || cap < PICK_SAMPLE || k < 1) return 0;
    for (int64_t j = 0; j < PICK_SAMPLE; ++j) samp[j] = u[j * m / PICK_SAMPLE] & 0x7fffffffu;
    int64_t r = (3 * k * PICK_SAMPLE + m - 1) / m;  /* ceil(3 k / m of the sample) */
    if (r > PICK_SAMPLE) return 0;
    if (radix_kth(samp, 1, 0xffffffffu, PICK_SAMPLE, r, keys, &floor_key, &ties) != 0) return -1;
    /* a sample of mostly exact zeros (alltoall's second stage: the mean of a few sparse payloads and
       a residual as sparse) floors at the nonzeros, which pass whenever at least k are */
    floor_key = floor_key ? floor_key : 1u;
    float floor_v;
    __builtin_memcpy(&floor_v, &floor_key, sizeof floor_v);
    float* cv = (float*)keys;  /* the candidates' |x|, then the select's own scratch past cap */
    const int64_t w = ac_select_abs_not_lt(vals, m, floor_v, cand, cv, cap);
    if (w < k || w > cap) return 0;
    /* the pick over those candidates, their values from the tensor */
    return ac_pick_largest(cv, cand, w, k, flat != NULL ? flat : vals, keys + cap, out_idx, out_vals) != 0 ? -1 : 1;
}
/* The mean of every rank's sparse payload into the dense output: +0.0 outside the union of the
   ranks' positions, and at a position ((0 + v_0) + v_1 + ...) / divisor with the ranks' values
   added in rank order: bitwise a zero buffer, index_add_ of the payloads concatenated in rank
   order, and div_ (adacomp.communicators.allgather). Block by block (16 KiB of output): a zero
   fill, the adds and, while those lines are still in L1, one division per touched position (a
   bitmap finds them): one write of the output instead of a zero fill, a scatter and a
   gather-divide-scatter over it. (Measured on the 2-core EPYC: one fill of the whole output first
   was slower; for large outputs see SM_STREAM_MIN below.) Each rank's positions must ascend
   strictly within [0, n): -1 otherwise, before anything is written. pos: world int64 of scratch. */
#define SM_BLOCK 4096
/* Outputs of at least SM_STREAM_MIN elements (past what the caches keep for the reader anyway) are
   built a block at a time in an L1 scratch block and written with non-temporal stores: the output's
   lines are never read first (a plain store reads each line before writing it), so the mean costs
   one write of the output instead of a read and a write. The same floats either way. From 2^16
   (not 2^18): ResNet-50's Top-k cost cell, alternating, 23.9 / 22.5 ms at 2^18 against 22.1 / 21.1
   ms at 2^16 (2^14: 21.3 / 23.7 ms); its 2^16-2^18-element outputs were written with a read first. */
#define SM_STREAM_MIN (1 << 16)
#if defined(AC_AVX2)
/* src, src * scale where scaled (every element: an untouched +0 stays +0), or zeros (src NULL) to out */
__attribute__((target("avx2"))) static void sm_stream(float* out, const float* src, int64_t len, int scaled,
                                                      float scale) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256 v = src ? _mm256_load_ps(src + i) : _mm256_setzero_ps();
        _mm256_stream_ps(out + i, scaled ? _mm256_mul_ps(v, sv) : v);
    }
    for (; i < len; ++i) out[i] = src ? (scaled ? src[i] * scale : src[i]) : 0.0f;
}
/* src * scale to out, streamed, and src set back to +0 as it is read (the streamed power-of-two path's
   scratch block: clean again for the next block without a loop over the lines it touched, whose exit
   was mispredicted about once a touched line) */
__attribute__((target("avx2"))) static void sm_stream_clear(float* out, float* src, int64_t len, float scale) {
    const __m256 sv = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256 v = _mm256_load_ps(src + i);
        _mm256_store_ps(src + i, zero);
        _mm256_stream_ps(out + i, _mm256_mul_ps(v, sv));
    }
    for (; i < len; ++i) {
        out[i] = src[i] * scale;
        src[i] = 0.0f;
    }
}
__attribute__((target("avx2"))) static void sm_fence(void) { _mm_sfence(); }
#endif
/* The sparse means' checks and divisor: each rank's positions strictly ascending in [0, n) (else -1);
   *pow2 where x / divisor is x * *inv exactly (x / 2^e and x * 2^-e round the same exact value: a
   product where the divisor allows it). */
static int sm_prepare(int64_t n, int world, const int64_t* const* idx, const int64_t* counts, int64_t* pos,
                      float divisor, int* pow2, float* inv) {
    for (int r = 0; r < world; ++r) {
        const int64_t* x = idx[r];
        for (int64_t i = 0; i < counts[r]; ++i)
            if (x[i] < 0 || x[i] >= n || (i > 0 && x[i] <= x[i - 1])) return -1;
        pos[r] = 0;
    }
    *pow2 = 0;
    *inv = 1.0f;
    for (float d = divisor; d >= 1.0f && d == (float)(int64_t)d; d *= 0.5f, *inv *= 0.5f)
        if (d == 1.0f) { *pow2 = 1; break; }
    return 0;
}
int ac_sparse_mean(float* out, int64_t n, int world, const int64_t* const* idx, const float* const* vals,
                   const int64_t* counts, int64_t* pos, float divisor) {
    int pow2;
    float inv;
    if (sm_prepare(n, world, idx, counts, pos, divisor, &pow2, &inv) != 0) return -1;
    uint64_t touched[SM_BLOCK / 64];
    int stream = 0;
#if defined(AC_AVX2)
    stream = n >= SM_STREAM_MIN && ((uintptr_t)out & 31) == 0 && use_avx2();
#endif
    float scratch[SM_BLOCK] __attribute__((aligned(32)));
    int clean = 0;  /* scratch all +0.0 (the streamed power-of-two path keeps it so between blocks) */
    for (int64_t b0 = 0; b0 < n; b0 += SM_BLOCK) {
        const int64_t b1 = n - b0 < SM_BLOCK ? n : b0 + SM_BLOCK;
        int any = 0;
        for (int r = 0; r < world && !any; ++r) any = pos[r] < counts[r] && idx[r][pos[r]] < b1;
#if defined(AC_AVX2)
        if (stream && !any) { sm_stream(out + b0, NULL, b1 - b0, 0, 1.0f); continue; }
        if (stream && pow2) {
            /* the scratch block is zero before the adds and set back to zero as its product is
               streamed out: no fill of the whole block each time */
            if (!clean) { __builtin_memset(scratch, 0, sizeof scratch); clean = 1; }
            for (int r = 0; r < world; ++r) {
                const int64_t* x = idx[r];
                const float* v = vals[r];
                int64_t p = pos[r];
                const int64_t c = counts[r];
                for (; p < c && x[p] < b1; ++p) scratch[x[p] - b0] += v[p];
                pos[r] = p;
            }
            sm_stream_clear(out + b0, scratch, b1 - b0, inv);
            continue;
        }
#endif
        float* o = stream ? scratch : out + b0;
        __builtin_memset(o, 0, (size_t)(b1 - b0) * sizeof(float));
        if (!any) continue;
        if (!(stream && pow2)) __builtin_memset(touched, 0, sizeof touched);
        for (int r = 0; r < world; ++r) {
            const int64_t* x = idx[r];
            const float* v = vals[r];
            int64_t p = pos[r];
            const int64_t c = counts[r];
            if (p < c && x[p] < b1) {
                for (; p < c && x[p] < b1; ++p) {
                    const int64_t j = x[p] - b0;
                    o[j] += v[p];
                    if (!(stream && pow2)) touched[j >> 6] |= (uint64_t)1 << (j & 63);
                }
                pos[r] = p;
            }
        }
#if defined(AC_AVX2)
        if (stream && pow2) {  /* the product on the way out: an untouched +0 stays +0 */
            sm_stream(out + b0, scratch, b1 - b0, 1, inv);
            continue;
        }
#endif
        for (int w = 0; w < SM_BLOCK / 64; ++w) {
            uint64_t m = touched[w];
            while (m) {
                const int j = (w << 6) + __builtin_ctzll(m);
                m &= m - 1;
                o[j] = pow2 ? o[j] * inv : o[j] / divisor;
            }
        }
#if defined(AC_AVX2)
        if (stream) sm_stream(out + b0, scratch, b1 - b0, 0, 1.0f);
#endif
    }
#if defined(AC_AVX2)
    if (stream) sm_fence();
#endif
    return 0;
}
/* ac_sparse_mean for m outputs in one call (a bucket's sparse entries; per call from Python ~5 us):
   output i takes rank r's counts[i * world + r] positions (int64) and values (float32) at byte offsets
   idx_off / val_off of the gathered buffer base. status[i]: ac_sparse_mean's result (-1: nothing of
   output i written, the caller's torch path runs). ip, vp: world pointers of scratch. */
void ac_sparse_mean_many(int64_t m, float* const* outs, const int64_t* ns, int world, const uint8_t* base,
                         const int64_t* idx_off, const int64_t* val_off, const int64_t* counts,
                         const int64_t** ip, const float** vp, int64_t* pos, float divisor, int32_t* status) {
    for (int64_t i = 0; i < m; ++i) {
        for (int r = 0; r < world; ++r) {
            ip[r] = (const int64_t*)(base + idx_off[i * world + r]);
            vp[r] = (const float*)(base + val_off[i * world + r]);
        }
        status[i] = ac_sparse_mean(outs[i], ns[i], world, ip, vp, counts + i * world, pos, divisor);
    }
}
#if defined(AC_AVX2)
/* ac_sparse_mean_add_select's scaling, add, store and compaction of one block, 64 elements a mask
   (the values kept in an L1 copy: out may have been streamed past the caches), the block's mean
   sums set back to +0 as they are read; returns how many elements it did (the rest: the scalar
   loop). An untouched sum is +0, and +0 * inv = +0 / divisor = +0, so every lane is scaled and
   cleared alike: the per-block loops over the touched positions (their exits mispredicted about once
   a position) and a branch per 8-lane vector with a passing lane cost as much as the vector work
   (cost_notes item 85). */
__attribute__((target("avx2"))) static int64_t sm_add_select_avx2(float* m, const float* r, float* out,
                                                                 int64_t len, float t, int pow2, float inv,
                                                                 float divisor, int stream, int64_t at,
                                                                 int64_t* idx, float* vals, int64_t cap,
                                                                 int64_t* count) {
    const __m256 tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    const __m256 iv = _mm256_set1_ps(inv), dv = _mm256_set1_ps(divisor);
    float blk[64] __attribute__((aligned(32)));
    int64_t c = *count, e = 0;
    for (; e + 64 <= len; e += 64) {
        uint64_t mask = 0;
        AC_AHEAD(r, e, 4);
        for (int q = 0; q < 8; ++q) {
            const int64_t o = e + 8 * q;
            const __m256 s = _mm256_load_ps(m + o);
            _mm256_store_ps(m + o, zero);
            const __m256 v = _mm256_add_ps(pow2 ? _mm256_mul_ps(s, iv) : _mm256_div_ps(s, dv), _mm256_loadu_ps(r + o));
            if (stream) _mm256_stream_ps(out + o, v); else _mm256_storeu_ps(out + o, v);
            _mm256_store_ps(blk + 8 * q, v);
            mask |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), tv, _CMP_NLT_UQ))
                    << (8 * q);
        }
        AC_EMIT64P(mask, at + e, blk, 0, blk[j])
    }
    *count = c;
    return e;
}
#endif
/* The samples' lines (ac_sample_lines, ac_sparse_sample_lines) are prefetched this many lines ahead. */
#define SAMPLE_AHEAD 24
/* alltoall's second stage in one pass over its part: out = m + r, m the ranks' sparse mean exactly as
   ac_sparse_mean writes it (+0 where no rank has a value, else the rank-order sum from +0, times
   2^-e or divided by divisor) and the add as torch.add's, written whole (streamed from
   AC_SELECT_STREAM_MIN elements into a 32-byte aligned out), with the compaction
   ac_add_select_abs_not_lt gives of out (positions ascending, signed values, count returned). The
   mean is never written: one read of r and one write of out instead of the mean's write, then a read
   of it and of r and a write. -1 (nothing written) where a rank's positions do not ascend strictly
   within [0, n). pos: world int64 of scratch. */
int64_t ac_sparse_mean_add_select(const float* r, float* out, int64_t n, int world, const int64_t* const* idx,
                                  const float* const* vals, const int64_t* counts, int64_t* pos, float divisor,
                                  float t, int64_t* cidx, float* cvals, int64_t cap) {
    int pow2;
    float inv;
    if (sm_prepare(n, world, idx, counts, pos, divisor, &pow2, &inv) != 0) return -1;
    float m[SM_BLOCK] __attribute__((aligned(32)));
    __builtin_memset(m, 0, sizeof m);
    int64_t c = 0;
    int stream = 0;
#if defined(AC_AVX2)
    stream = n >= AC_SELECT_STREAM_MIN && ((uintptr_t)out & 31) == 0 && use_avx2();
#endif
    for (int64_t b0 = 0; b0 < n; b0 += SM_BLOCK) {
        const int64_t len = n - b0 < SM_BLOCK ? n - b0 : SM_BLOCK;
        for (int q = 0; q < world; ++q) {  /* the ranks' sums in rank order from +0 */
            const int64_t* x = idx[q];
            const float* v = vals[q];
            int64_t p = pos[q];
            for (; p < counts[q] && x[p] < b0 + len; ++p) m[x[p] - b0] += v[p];
            pos[q] = p;
        }
        const float* rb = r + b0;
        float* ob = out + b0;
        int64_t j = 0;
#if defined(AC_AVX2)
        if (use_avx2()) j = sm_add_select_avx2(m, rb, ob, len, t, pow2, inv, divisor, stream, b0, cidx, cvals, cap, &c);
#endif
        for (; j < len; ++j) {  /* the sum scaled (+0 stays +0), added, and set back to +0 */
            const float a = pow2 ? m[j] * inv : m[j] / divisor;
            m[j] = 0.0f;
            const float v = a + rb[j];
            ob[j] = v;
            if (!(__builtin_fabsf(v) < t)) { if (c < cap) { cidx[c] = b0 + j; cvals[c] = v; } ++c; }
        }
    }
#if defined(AC_AVX2)
    if (stream) sm_fence();
#endif
    return c;
}
/* The j-th of m sample lines among `lines` (adacomp.compressors.sparse.sample_starts): one line of the
   j-th of m equal spans, at the fraction of the span a Weyl sequence gives (j / golden ratio, mod 1, in
   32-bit fixed point); ascending in j. The span's first line instead aliased with a matrix's rows (a
   span of 2304 floats on GPT-2's 768 x 3072 weights met 4 columns, VGG-16's fc6 one): on VGG-16's
   own gradients the sampled floors passed 0.22-14.6 times their target, 1.06-2.28 times since
   (adacomp bench cost floors, cost_notes item 53). */
static inline int64_t sample_line(int64_t j, int64_t lines, int64_t m) {
    const int64_t lo = j * lines / m, span = (j + 1) * lines / m - lo;
    const uint64_t frac = ((uint64_t)j * 2654435769u) & 0xffffffffu;
    return lo + (int64_t)((frac * (uint64_t)span) >> 32);
}
/* The sample ac_sample_lines takes of a + r where a is the ranks' sparse mean as ac_sparse_mean writes
   it (see ac_sparse_mean_add_select): m runs of 16 floats at the lines sample_line gives, each position's
   mean from the payloads (walked once in order beside the ascending lines: a binary search per rank
   and line cost 150 us a sample, 2.3x the dense sample). -1 as there. */
int ac_sparse_sample_lines(const float* r, int64_t n, int world, const int64_t* const* idx,
                           const float* const* vals, const int64_t* counts, int64_t* pos, float divisor,
                           int64_t lines, int64_t m, float* out) {
    int pow2;
    float inv;
    if (sm_prepare(n, world, idx, counts, pos, divisor, &pow2, &inv) != 0) return -1;
    for (int64_t j = 0; j < m; ++j) {
        if (j + SAMPLE_AHEAD < m) __builtin_prefetch(r + sample_line(j + SAMPLE_AHEAD, lines, m) * 16);  /* as ac_sample_lines */
        const int64_t at = sample_line(j, lines, m) * 16;
        float a[16] = {0};
        int hit[16] = {0};
        for (int q = 0; q < world; ++q) {
            const int64_t* x = idx[q];
            int64_t lo = pos[q];
            while (lo < counts[q] && x[lo] < at) ++lo;  /* a merge walk: each payload read once, in order */
            pos[q] = lo;
            for (int64_t p = lo; p < counts[q] && x[p] < at + 16; ++p) {
                a[x[p] - at] += vals[q][p];
                hit[x[p] - at] = 1;
            }
        }
        for (int e = 0; e < 16; ++e) {
            const float mean = hit[e] ? (pow2 ? a[e] * inv : a[e] / divisor) : 0.0f;
            out[16 * j + e] = mean + r[at + e];
        }
    }
    return 0;
}
/* Payload tensors into the send buffer of `total` bytes at their segments' offsets (ascending), every
   byte between and after them zeroed (adacomp.communicators.allgather.pack): one call instead of a
   zero fill and a slice assignment per tensor. */
void ac_copy_many(uint8_t* buf, int64_t total, int64_t m, const void* const* src, const int64_t* off,
                  const int64_t* nbytes) {
    int64_t end = 0;
    for (int64_t i = 0; i < m; ++i) {
        if (off[i] > end) __builtin_memset(buf + end, 0, (size_t)(off[i] - end));
        if (nbytes[i] > 0) __builtin_memcpy(buf + off[i], src[i], (size_t)nbytes[i]);
        end = off[i] + nbytes[i];
    }
    if (total > end) __builtin_memset(buf + end, 0, (size_t)(total - end));
}
/* The sample of adacomp.compressors.sparse.sample_lines: m runs of 16 floats starting at the lines
   sample_line(j, lines, m) of a, or of a + b (one IEEE add, as torch.add) when b is given.
   The lines lie far apart (a tensor's memory, not in cache while a step streams the model): each is
   prefetched SAMPLE_AHEAD lines before it is read, so many misses are in flight at once. */
/* ac_sample_lines of a = the concatenation of nseg segments (gs[s], lens[s] elements each), read
   where they lie, plus b (not NULL): the same positions, the same adds. */
void ac_sample_lines_segments(const int64_t* gs, const int64_t* lens, int64_t nseg, const float* b, int64_t lines,
                              int64_t m, float* out) {
    int64_t s = 0, off = 0;  /* the segment holding the position reached (positions ascend) */
    for (int64_t j = 0; j < m; ++j) {
        const int64_t at = sample_line(j, lines, m) * 16;
        for (int t = 0; t < 16; ++t) {
            while (s < nseg && at + t >= off + lens[s]) off += lens[s++];
            out[j * 16 + t] = ((const float*)(intptr_t)gs[s])[at + t - off] + b[at + t];
        }
    }
}
void ac_sample_lines(const float* a, const float* b, int64_t lines, int64_t m, float* out) {
    for (int64_t j = 0; j < m; ++j) {
        if (j + SAMPLE_AHEAD < m) {
            const int64_t ahead = sample_line(j + SAMPLE_AHEAD, lines, m) * 16;
            __builtin_prefetch(a + ahead);
            if (b != NULL) __builtin_prefetch(b + ahead);
        }
        const int64_t at = sample_line(j, lines, m) * 16;
        if (b != NULL) for (int t = 0; t < 16; ++t) out[j * 16 + t] = a[at + t] + b[at + t];
        else for (int t = 0; t < 16; ++t) out[j * 16 + t] = a[at + t];
    }
}
/* ac_sample_lines of a + b with b read as +0.0 at the zm ascending positions zi (the residual's zeroing
   left to error feedback's next pass, ac_add_abs_stats_select): the sample that pass's sum gives. */
void ac_sample_lines_zeroed(const float* a, const float* b, int64_t lines, int64_t m, float* out, const int64_t* zi,
                            int64_t zm) {
    int64_t lo = 0;  /* the first zeroed position >= the line's start: the lines ascend, so it only moves on */
    for (int64_t j = 0; j < m; ++j) {
        if (j + SAMPLE_AHEAD < m) {
            const int64_t ahead = sample_line(j + SAMPLE_AHEAD, lines, m) * 16;
            __builtin_prefetch(a + ahead);
            __builtin_prefetch(b + ahead);
        }
        const int64_t at = sample_line(j, lines, m) * 16;
        /* past the positions before the line: galloping, then bisection (bisection alone, from scratch a
           line, cost 3.4 ms a step of ResNet-50's Top-k in cache misses) */
        if (lo < zm && zi[lo] < at) {
            int64_t step = 1;
            while (lo + step < zm && zi[lo + step] < at) step *= 2;
            int64_t l = lo + step / 2 + 1, h = lo + step < zm ? lo + step : zm;
            while (l < h) {
                const int64_t mid = l + (h - l) / 2;
                if (zi[mid] < at) l = mid + 1; else h = mid;
            }
            lo = l;
        }
        if (lo >= zm || zi[lo] >= at + 16) {  /* most lines hold no zeroed position */
            for (int t = 0; t < 16; ++t) out[j * 16 + t] = a[at + t] + b[at + t];
            continue;
        }
        for (int t = 0; t < 16; ++t) {
            const int zeroed = lo < zm && zi[lo] == at + t;
            lo += zeroed;
            out[j * 16 + t] = a[at + t] + (zeroed ? 0.0f : b[at + t]);
        }
    }
}
/* PowerSGD's P Q^T (n x r times r x m, qt = Q^T contiguous) as MKL's sgemm computes it on x86 with
   FMA: each output an fmaf chain over k = 0 .. r - 1 from a +0 accumulator (signed zeros included).
   adacomp.compressors._lowrank uses it only where it gave torch's bits for the layout. Built twice:
   for CPUs with AVX2 + FMA (vfmadd) and without (the C library's fmaf, the same result), picked by
   what the CPU reports. */
/* Rows longer than L1 holds: each output's chain runs in a register (the rank loop innermost,
   unrolled for ranks up to 8) and is stored once, the same fmaf sequence per element as the
   rank-outer loop, without re-reading and re-writing the row r times (VGG-16's fc6 rows are 100 KB).
   Shorter rows keep the rank-outer loop, which is faster while the row sits in L1. */
#define OUTER_ROW_L1 8192 /* floats of a row that stays in L1 through r rank-outer passes: those keep them */
#define OUTER_FMA_R(R)                                                                  \
    for (int64_t j = 0; j < m; ++j) {                                                   \
        float acc = 0.0f;                                                               \
        for (int k = 0; k < (R); ++k) acc = __builtin_fmaf(pi[k], qt[k * m + j], acc);  \
        o[j] = acc;                                                                     \
    }
/* a switch's cases for ranks 1 .. 8, each running BODY with its rank as a constant (the loop unrolls) */
#define AC_RANK_CASES(BODY)                                                             \
    case 1: BODY(1); break; case 2: BODY(2); break; case 3: BODY(3); break;             \
    case 4: BODY(4); break; case 5: BODY(5); break; case 6: BODY(6); break;             \
    case 7: BODY(7); break; case 8: BODY(8); break;
#define OUTER_FMA_BODY                                                                  \
    for (int64_t i = 0; i < n; ++i) {                                                   \
        float* o = out + i * m;                                                         \
        const float* pi = p + i * r;                                                    \
        switch (m > OUTER_ROW_L1 ? r : 0) {                                             \
        AC_RANK_CASES(OUTER_FMA_R)                                                      \
        default:                                                                        \
            for (int64_t j = 0; j < m; ++j) o[j] = 0.0f;                                \
            for (int64_t k = 0; k < r; ++k) {                                           \
                const float a = pi[k];                                                  \
                const float* q = qt + k * m;                                            \
                for (int64_t j = 0; j < m; ++j) o[j] = __builtin_fmaf(a, q[j], o[j]);   \
            }                                                                           \
        }                                                                               \
    }
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static void outer_fma_hw(const float* p, const float* qt, int64_t n, int64_t m,
                                                             int64_t r, float* out) { OUTER_FMA_BODY }
/* Large outputs (AC_STREAM_MIN): the same fmaf chain per element in a register, streamed to out,
   whose lines are then not read first (the product goes to memory anyway). */
__attribute__((target("avx2,fma"))) static void outer_fma_stream(const float* p, const float* qt, int64_t n,
                                                                 int64_t m, int64_t r, float* out) {
    for (int64_t i = 0; i < n; ++i) {
        float* o = out + i * m;
        const float* pi = p + i * r;
        int64_t j = 0;
        for (; j < m && ((uintptr_t)(o + j) & 31); ++j) {
            float acc = 0.0f;
            for (int64_t k = 0; k < r; ++k) acc = __builtin_fmaf(pi[k], qt[k * m + j], acc);
            o[j] = acc;
        }
        for (; j + 8 <= m; j += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = 0; k < r; ++k)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(pi[k]), _mm256_loadu_ps(qt + k * m + j), acc);
            _mm256_stream_ps(o + j, acc);
        }
        for (; j < m; ++j) {
            float acc = 0.0f;
            for (int64_t k = 0; k < r; ++k) acc = __builtin_fmaf(pi[k], qt[k * m + j], acc);
            o[j] = acc;
        }
    }
    _mm_sfence();
}
#endif
static void outer_fma_sw(const float* p, const float* qt, int64_t n, int64_t m, int64_t r, float* out) {
    OUTER_FMA_BODY
}
void ac_outer_fma(const float* p, const float* qt, int64_t n, int64_t m, int64_t r, float* out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        if (n * m >= AC_STREAM_MIN && use_avx2()) outer_fma_stream(p, qt, n, m, r, out);
        else outer_fma_hw(p, qt, n, m, r, out);
        return;
    }
#endif
    outer_fma_sw(p, qt, n, m, r, out);
}
/* The two long products of the low-rank compressors as torch's CPU matmul / mv form them for a
   narrow factor (seen on x86; the caller checks the bits per layout), in one of two orders chosen
   by kc:
   kc = 0: every output one sum from +0, one IEEE product and one IEEE addition per term, terms in
     order, no FMA (torch's kernels on the 2-core EPYC);
   kc > 0: the terms in blocks (seq_block_end), each block an fmaf chain from +0 in term order, the
     blocks' sums added in order (MKL's AVX-512 sgemm on a Xeon, with kc 384: seen on every
     ResNet-50 and GPT-2-small layout, where torch otherwise took 2-3 memory floors a product).
   ac_mm_seq: P = M Q (M n x m, Q m x r, both row-major; P n x r), the terms along a row of M. With
   AVX2, eight rows at a time: each 8 x 8 block of M is transposed in registers so one vector holds
   a column's eight values, and each rank's eight sums live in a register. */
static inline int64_t seq_block_end(int64_t k0, int64_t m, int64_t kc) {
    /* blocks of kc while more than 2 kc terms are left, then the rest in two halves (the first the
       longer by one) or, at most kc left, one block; kc 0: one block */
    const int64_t rem = m - k0;
    if (kc <= 0 || rem <= kc) return m;
    return rem > 2 * kc ? k0 + kc : k0 + (rem + 1) / 2;
}
static float seq_dot(const float* x, int64_t step, const float* y, int64_t ystep, int64_t m, int64_t kc) {
    float sum = 0.0f;
    for (int64_t k0 = 0, k1; k0 < m; k0 = k1) {
        k1 = seq_block_end(k0, m, kc);
        float acc = 0.0f;
        if (kc) for (int64_t c = k0; c < k1; ++c) acc = __builtin_fmaf(x[c * step], y[c * ystep], acc);
        else for (int64_t c = k0; c < k1; ++c) acc = acc + x[c * step] * y[c * ystep];
        sum = k0 == 0 ? acc : sum + acc;
    }
    return sum;
}
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static inline void transpose8(__m256* v) {
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    v[0] = _mm256_permute2f128_ps(s0, s4, 0x20); v[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    v[2] = _mm256_permute2f128_ps(s2, s6, 0x20); v[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    v[4] = _mm256_permute2f128_ps(s0, s4, 0x31); v[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    v[6] = _mm256_permute2f128_ps(s2, s6, 0x31); v[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
/* One term of the eight rows' sums (COL: column C's eight values), in either order; at a block's
   end (C == k1) the block's sums are first added to the total (the first block's taken as is). */
#define MM_SEQ_TERM(COL, C, R)                                                          \
    for (int j = 0; j < (R); ++j)                                                       \
        acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps((COL), _mm256_set1_ps(Q[(C) * (R) + j])));
#define MM_BLK_TERM(COL, C, R)                                                          \
    for (int j = 0; j < (R); ++j)                                                       \
        acc[j] = _mm256_fmadd_ps((COL), _mm256_set1_ps(Q[(C) * (R) + j]), acc[j]);
#define MM_FOLD(R)                                                                      \
    for (int j = 0; j < (R); ++j) {                                                     \
        sum[j] = first ? acc[j] : _mm256_add_ps(sum[j], acc[j]);                        \
        acc[j] = _mm256_setzero_ps();                                                   \
    }                                                                                   \
    first = 0;
#define MM_STEP(TERM, COL, C, R)                                                        \
    {                                                                                   \
        if ((C) == k1) { MM_FOLD(R) k1 = seq_block_end(k1, m, kc); }                    \
        TERM(COL, C, R)                                                                 \
    }
/* the eight rows' sums (lane l of sum[j]: row i + l, column j) into P, row-major n x R */
#define MM_SEQ_STORE(R)                                                                 \
    {                                                                                   \
        float t[R][8];                                                                  \
        for (int j = 0; j < (R); ++j) _mm256_storeu_ps(t[j], sum[j]);                   \
        for (int l = 0; l < 8; ++l)                                                     \
            for (int j = 0; j < (R); ++j) P[(i + l) * (R) + j] = t[j][l];               \
    }
#define MM_ROWS_AVX2(R, NAME, TERM, TARGET)                                             \
__attribute__((target(TARGET))) static void NAME##_##R(const float* M, int64_t n, int64_t m, \
        const float* Q, float* P, int64_t kc, int64_t* done) {                          \
    int64_t i = 0;                                                                      \
    for (; i + 8 <= n; i += 8) {                                                        \
        __m256 acc[R], sum[R], v[8];                                                    \
        const int64_t ahead = i + 16 <= n ? 8 : 0; /* the next 8 rows, fetched while these are summed */ \
        int first = 1;                                                                  \
        int64_t k1 = seq_block_end(0, m, kc);                                           \
        for (int j = 0; j < (R); ++j) acc[j] = sum[j] = _mm256_setzero_ps();            \
        int64_t c = 0;                                                                  \
        for (; c + 8 <= m; c += 8) {                                                    \
            for (int l = 0; l < 8; ++l) {                                               \
                v[l] = _mm256_loadu_ps(M + (i + l) * m + c);                            \
                _mm_prefetch((const char*)(M + (i + ahead + l) * m + c), _MM_HINT_T0);  \
            }                                                                           \
            transpose8(v);                                                              \
            for (int t = 0; t < 8; ++t) MM_STEP(TERM, v[t], c + t, R)                   \
        }                                                                               \
        for (; c < m; ++c) {                                                            \
            const float* b = M + i * m + c;                                             \
            const __m256 col = _mm256_setr_ps(b[0], b[m], b[2 * m], b[3 * m], b[4 * m], b[5 * m], \
                                              b[6 * m], b[7 * m]);                      \
            MM_STEP(TERM, col, c, R)                                                    \
        }                                                                               \
        if (m > 0) { MM_FOLD(R) }                                                       \
        MM_SEQ_STORE(R)                                                                 \
    }                                                                                   \
    *done = i;                                                                          \
}
#define MM_SEQ_AVX2(R) MM_ROWS_AVX2(R, mm_seq_avx2, MM_SEQ_TERM, "avx2") MM_ROWS_AVX2(R, mm_blk_avx2, MM_BLK_TERM, "avx2,fma")
MM_SEQ_AVX2(1) MM_SEQ_AVX2(2) MM_SEQ_AVX2(3) MM_SEQ_AVX2(4)
MM_SEQ_AVX2(5) MM_SEQ_AVX2(6) MM_SEQ_AVX2(7) MM_SEQ_AVX2(8)
#define MM_SEQ_CALL(R) mm_seq_avx2_##R(M, n, m, Q, P, kc, &i)
#define MM_BLK_CALL(R) mm_blk_avx2_##R(M, n, m, Q, P, kc, &i)
#endif
static int fma_hw(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}
void ac_mm_seq(const float* M, int64_t n, int64_t m, const float* Q, int64_t r, float* P, int64_t kc) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (use_avx2() && !kc) switch (r) { AC_RANK_CASES(MM_SEQ_CALL) default: break; }
    if (use_avx2() && kc && fma_hw()) switch (r) { AC_RANK_CASES(MM_BLK_CALL) default: break; }
#endif
    for (; i < n; ++i)
        for (int64_t j = 0; j < r; ++j) P[i * r + j] = seq_dot(M + i * m, 1, Q + j, r, m, kc);
}
/* ac_mtm_seq: Y = F^T M (M n x m, F n x r row-major; Y r x m), the terms down a column of M (the
   rows of M in order): for long rows four rows of M at a time are added to a sum while it is in a
   register, over column chunks whose rows and sums stay in L1; M is read once. With kc, a block
   of rows after the first sums into a chunk of its own, then added to the total. */
#define MTM_SEQ_COLS 1024
AC_CLONES static void mtm_seq_add(const float* M, int64_t n, int64_t m, const float* F, int64_t r, float* Y) {
    for (int64_t c0 = 0; c0 < m; c0 += MTM_SEQ_COLS) {
        const int64_t c1 = m - c0 < MTM_SEQ_COLS ? m : c0 + MTM_SEQ_COLS;
        for (int64_t j = 0; j < r; ++j)
            for (int64_t c = c0; c < c1; ++c) Y[j * m + c] = 0.0f;
        int64_t i = 0;
        for (; m > MTM_SEQ_COLS && i + 4 <= n; i += 4) {  /* (short rows: one at a time was faster) */
            const float *m0 = M + i * m, *m1 = m0 + m, *m2 = m1 + m, *m3 = m2 + m;
            for (int64_t j = 0; j < r; ++j) {
                const float f0 = F[i * r + j], f1 = F[(i + 1) * r + j], f2 = F[(i + 2) * r + j],
                            f3 = F[(i + 3) * r + j];
                float* y = Y + j * m;
                for (int64_t c = c0; c < c1; ++c) y[c] = (((y[c] + f0 * m0[c]) + f1 * m1[c]) + f2 * m2[c]) + f3 * m3[c];
            }
        }
        for (; i < n; ++i) {
            const float* mi = M + i * m;
            for (int64_t j = 0; j < r; ++j) {
                const float f = F[i * r + j];
                float* y = Y + j * m;
                for (int64_t c = c0; c < c1; ++c) y[c] = y[c] + f * mi[c];
            }
        }
    }
}
/* Y[j][c0 .. c1) (row stride ys) += the fmaf chain over rows i0 .. i1 of M, four rows at a time */
#define MTM_BLK_BODY(FMA8)                                                              \
    int64_t i = i0;                                                                     \
    for (; i + 4 <= i1; i += 4) {                                                       \
        const float *m0 = M + i * m, *m1 = m0 + m, *m2 = m1 + m, *m3 = m2 + m;          \
        for (int64_t j = 0; j < r; ++j) {                                               \
            const float f0 = F[i * r + j], f1 = F[(i + 1) * r + j], f2 = F[(i + 2) * r + j], \
                        f3 = F[(i + 3) * r + j];                                        \
            float* y = Y + j * ys - c0;                                                 \
            int64_t c = c0;                                                             \
            FMA8                                                                        \
            for (; c < c1; ++c)                                                         \
                y[c] = __builtin_fmaf(f3, m3[c], __builtin_fmaf(f2, m2[c], __builtin_fmaf(f1, m1[c], __builtin_fmaf(f0, m0[c], y[c])))); \
        }                                                                               \
    }                                                                                   \
    for (; i < i1; ++i) {                                                               \
        const float* mi = M + i * m;                                                    \
        for (int64_t j = 0; j < r; ++j) {                                               \
            const float f = F[i * r + j];                                               \
            float* y = Y + j * ys - c0;                                                 \
            for (int64_t c = c0; c < c1; ++c) y[c] = __builtin_fmaf(f, mi[c], y[c]);    \
        }                                                                               \
    }
static void mtm_blk_rows_sw(const float* M, int64_t i0, int64_t i1, int64_t m, int64_t c0, int64_t c1,
                            const float* F, int64_t r, float* Y, int64_t ys) { MTM_BLK_BODY() }
#if defined(__x86_64__) && defined(__GNUC__)
#define MTM_FMA8                                                                        \
    for (; c + 8 <= c1; c += 8) {                                                       \
        __m256 v = _mm256_loadu_ps(y + c);                                              \
        v = _mm256_fmadd_ps(_mm256_set1_ps(f0), _mm256_loadu_ps(m0 + c), v);            \
        v = _mm256_fmadd_ps(_mm256_set1_ps(f1), _mm256_loadu_ps(m1 + c), v);            \
        v = _mm256_fmadd_ps(_mm256_set1_ps(f2), _mm256_loadu_ps(m2 + c), v);            \
        v = _mm256_fmadd_ps(_mm256_set1_ps(f3), _mm256_loadu_ps(m3 + c), v);            \
        _mm256_storeu_ps(y + c, v);                                                     \
    }
__attribute__((target("avx2,fma"))) static void mtm_blk_rows_hw(const float* M, int64_t i0, int64_t i1, int64_t m,
        int64_t c0, int64_t c1, const float* F, int64_t r, float* Y, int64_t ys) { MTM_BLK_BODY(MTM_FMA8) }
#endif
static void mtm_blk(const float* M, int64_t n, int64_t m, const float* F, int64_t r, float* Y, int64_t kc) {
    float part[8 * MTM_SEQ_COLS];  /* a later block's sums of one chunk (r <= 8) */
    void (*rows)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t) =
        mtm_blk_rows_sw;
#if defined(__x86_64__) && defined(__GNUC__)
    if (use_avx2() && fma_hw()) rows = mtm_blk_rows_hw;
#endif
    for (int64_t c0 = 0; c0 < m; c0 += MTM_SEQ_COLS) {
        const int64_t c1 = m - c0 < MTM_SEQ_COLS ? m : c0 + MTM_SEQ_COLS, w = c1 - c0;
        for (int64_t j = 0; j < r; ++j)
            for (int64_t c = c0; c < c1; ++c) Y[j * m + c] = 0.0f;
        for (int64_t i0 = 0, i1; i0 < n; i0 = i1) {
            i1 = seq_block_end(i0, n, kc);
            if (i0 == 0) { rows(M, i0, i1, m, c0, c1, F, r, Y + c0, m); continue; }
            for (int64_t e = 0; e < r * w; ++e) part[e] = 0.0f;
            rows(M, i0, i1, m, c0, c1, F, r, part, w);
            for (int64_t j = 0; j < r; ++j)
                for (int64_t c = 0; c < w; ++c) Y[j * m + c0 + c] = Y[j * m + c0 + c] + part[j * w + c];
        }
    }
}
void ac_mtm_seq(const float* M, int64_t n, int64_t m, const float* F, int64_t r, float* Y, int64_t kc) {
    if (kc) mtm_blk(M, n, m, F, r, Y, kc);
    else mtm_seq_add(M, n, m, F, r, Y);
}
/* Error feedback of a rank-r approximation without writing it: out = a - P Q^T, each product the fmaf
   chain ac_outer_fma forms (k = 0 .. r - 1 from a +0 accumulator) followed by one IEEE subtraction,
   so out is bitwise torch.sub(a, ac_outer_fma's output). The chain runs in a register per output
   (the rank loop innermost, unrolled for ranks up to 8; larger ranks take the same loop, slower).
   With g (not NULL): out = g + (a - P Q^T), that residual then the next step's compensation, one IEEE
   addition more (g first, as torch.add(g, r)): a residual left owed is added without being written.
   STORE(J, ACC) is the per-output tail of either form. */
#define OUTER_SUB_STORE(J, ACC) o[J] = ai[J] - (ACC)
#define OUTER_ADD_STORE(J, ACC) o[J] = gi[J] + (ai[J] - (ACC))
#define OUTER_SUB_R(R, STORE)                                                           \
    for (int64_t j = j0; j < j1; ++j) {                                                 \
        float acc = 0.0f;                                                               \
        for (int k = 0; k < (R); ++k) acc = __builtin_fmaf(pi[k], qt[k * m + j], acc);  \
        STORE(j, acc);                                                                  \
    }
#define OUTER_SUB_R_SUB(R) OUTER_SUB_R(R, OUTER_SUB_STORE)
#define OUTER_SUB_R_ADD(R) OUTER_SUB_R(R, OUTER_ADD_STORE)
/* Columns in chunks of OUTER_SUB_COLS, every row over one chunk before the next: the chunk of Q^T
   (r x 1024 floats) stays in L1 while the rows stream past. */
#define OUTER_SUB_COLS 1024
#define OUTER_SUB_BODY(CASE, STORE)                                                     \
    for (int64_t j0 = 0; j0 < m; j0 += OUTER_SUB_COLS) {                                \
        const int64_t j1 = m - j0 < OUTER_SUB_COLS ? m : j0 + OUTER_SUB_COLS;           \
        for (int64_t i = 0; i < n; ++i) {                                               \
            float* o = out + i * m;                                                     \
            const float* ai = a + i * m;                                                \
            const float* gi = g ? g + i * m : 0;                                        \
            const float* pi = p + i * r;                                                \
            (void)gi;                                                                   \
            switch (r) {                                                                \
            AC_RANK_CASES(CASE)                                                         \
            default:                                                                    \
                for (int64_t j = j0; j < j1; ++j) {                                     \
                    float acc = 0.0f;                                                   \
                    for (int64_t k = 0; k < r; ++k) acc = __builtin_fmaf(pi[k], qt[k * m + j], acc); \
                    STORE(j, acc);                                                      \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    }
#define OUTER_SUB_FUNCS(ATTR, NAME)                                                     \
ATTR static void NAME##_sub(const float* p, const float* qt, const float* a, const float* g, int64_t n, \
                            int64_t m, int64_t r, float* out) { OUTER_SUB_BODY(OUTER_SUB_R_SUB, OUTER_SUB_STORE) } \
ATTR static void NAME##_add(const float* p, const float* qt, const float* a, const float* g, int64_t n, \
                            int64_t m, int64_t r, float* out) { OUTER_SUB_BODY(OUTER_SUB_R_ADD, OUTER_ADD_STORE) }
#if defined(__x86_64__) && defined(__GNUC__)
OUTER_SUB_FUNCS(__attribute__((target("avx2,fma"))), outer_hw)
#endif
OUTER_SUB_FUNCS(, outer_sw)
#if defined(__x86_64__) && defined(__GNUC__)
/* Four rows at a time in order (a, g and out: sequential streams), eight columns a vector: each
   vector of Q^T is loaded once for the four rows (a quarter of the cache traffic of a row at a time)
   and the four rows' fma chains are independent (their latency overlaps). The same fmaf chain from
   +0 and the same subtraction (and addition) per output; out streamed where aligned and large. */
__attribute__((target("avx2,fma"))) static void outer_sub_rows(const float* p, const float* qt, const float* a,
                                                               const float* g, int64_t n, int64_t m, int64_t r,
                                                               float* out) {
    const int stream = n * m >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0 && (m & 7) == 0 && use_avx2();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        int64_t j = 0;
        for (; j + 8 <= m; j += 8) {
            __m256 acc[4];
            for (int u = 0; u < 4; ++u) acc[u] = _mm256_setzero_ps();
            for (int64_t k = 0; k < r; ++k) {
                const __m256 qk = _mm256_loadu_ps(qt + k * m + j);
                for (int u = 0; u < 4; ++u) acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(p[(i + u) * r + k]), qk, acc[u]);
            }
            for (int u = 0; u < 4; ++u) {
                const int64_t e = (i + u) * m + j;
                __m256 v = _mm256_sub_ps(_mm256_loadu_ps(a + e), acc[u]);
                if (g) v = _mm256_add_ps(_mm256_loadu_ps(g + e), v);
                if (stream) _mm256_stream_ps(out + e, v);
                else _mm256_storeu_ps(out + e, v);
            }
        }
        for (; j < m; ++j)
            for (int u = 0; u < 4; ++u) {
                const int64_t e = (i + u) * m + j;
                float acc = 0.0f;
                for (int64_t k = 0; k < r; ++k) acc = __builtin_fmaf(p[(i + u) * r + k], qt[k * m + j], acc);
                out[e] = g ? g[e] + (a[e] - acc) : a[e] - acc;
            }
    }
    for (; i < n; ++i)
        for (int64_t j = 0; j < m; ++j) {
            const int64_t e = i * m + j;
            float acc = 0.0f;
            for (int64_t k = 0; k < r; ++k) acc = __builtin_fmaf(p[i * r + k], qt[k * m + j], acc);
            out[e] = g ? g[e] + (a[e] - acc) : a[e] - acc;
        }
    if (stream) _mm_sfence();
}
#endif
/* Rows split into column chunks (m > OUTER_SUB_COLS) of a matrix past the caches take the four-row
   loop: the chunked order then reads a and writes out in 4 KiB pieces a row apart (2x slower than a
   copy on the 2-core EPYC, VGG-16's fc6 at 0.55 ns per element against the four-row loop's 0.28).
   Smaller or narrower ones stay with the chunks, faster there. g: see OUTER_ADD_STORE (may be NULL). */
#define OUTER_SUB_ROWS_MIN (1 << 20)
void ac_outer_fma_sub(const float* p, const float* qt, const float* a, const float* g, int64_t n, int64_t m,
                      int64_t r, float* out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        if (m > OUTER_SUB_COLS && n * m >= OUTER_SUB_ROWS_MIN && n >= 4 && use_avx2()) outer_sub_rows(p, qt, a, g, n, m, r, out);
        else (g ? outer_hw_add : outer_hw_sub)(p, qt, a, g, n, m, r, out);
        return;
    }
#endif
    (g ? outer_sw_add : outer_sw_sub)(p, qt, a, g, n, m, r, out);
}
/* A low-rank compressor's owed compensation and its first product in one pass over the rows:
   out = g + (a - P0 Q0^T) (ac_outer_fma_sub with g: the fmaf chain over r0 from +0, one subtraction,
   one addition) and P = out Q (ac_mm_seq in the order kc picks), bitwise the two calls one after the
   other, without reading out back. Eight rows at a time, eight columns a vector: each vector of
   Q0^T is loaded once for the eight rows (independent fma chains), the eight row vectors are
   written to out (streamed where aligned and large) and, still in registers, transposed into the
   eight rows' sums as ac_mm_seq's AVX2 loop does. Rows left over (n % 8) take the scalar forms.
   Returns -1 where it cannot run (no AVX2 + FMA, or r outside 1..8): the caller runs the two passes. */
#if defined(AC_AVX2)
#define OWED_ROWS_AVX2(R, NAME, TERM)                                                   \
__attribute__((target("avx2,fma"))) static void NAME##_##R(const float* p0, const float* qt0, int64_t r0, \
        const float* a, const float* g, int64_t n, int64_t m, float* out, const float* Q, float* P, \
        int64_t kc, int64_t* done) {                                                    \
    const int stream = n * m >= AC_STREAM_MIN && ((uintptr_t)out & 63) == 0 && (m & 15) == 0; \
    float line[8][16] __attribute__((aligned(64)));                                     \
    int64_t i = 0;                                                                      \
    for (; i + 8 <= n; i += 8) {                                                        \
        __m256 acc[R], sum[R], v[8];                                                    \
        int first = 1;                                                                  \
        int64_t k1 = seq_block_end(0, m, kc);                                           \
        for (int j = 0; j < (R); ++j) acc[j] = sum[j] = _mm256_setzero_ps();            \
        const float* pr = p0 + i * r0;                                                  \
        int64_t c = 0;                                                                  \
        for (; c + 8 <= m; c += 8) {                                                    \
            for (int u = 0; u < 8; ++u) v[u] = _mm256_setzero_ps();                     \
            for (int64_t k = 0; k < r0; ++k) {                                          \
                const __m256 qk = _mm256_loadu_ps(qt0 + k * m + c);                     \
                for (int u = 0; u < 8; ++u) v[u] = _mm256_fmadd_ps(_mm256_set1_ps(pr[u * r0 + k]), qk, v[u]); \
            }                                                                           \
            for (int u = 0; u < 8; ++u) {                                               \
                const int64_t e = (i + u) * m + c;                                      \
                v[u] = _mm256_add_ps(_mm256_loadu_ps(g + e), _mm256_sub_ps(_mm256_loadu_ps(a + e), v[u])); \
                if (!stream) _mm256_storeu_ps(out + e, v[u]);                           \
                else if (!(c & 8)) _mm256_store_ps(line[u], v[u]);                      \
                else { /* a row's whole 64-byte line at once: eight half-written lines in flight \
                          were 3.5x slower than plain stores on the Xeon */             \
                    _mm256_stream_ps(out + e - 8, _mm256_load_ps(line[u]));             \
                    _mm256_stream_ps(out + e, v[u]);                                    \
                }                                                                       \
            }                                                                           \
            transpose8(v);                                                              \
            for (int t = 0; t < 8; ++t) MM_STEP(TERM, v[t], c + t, R)                   \
        }                                                                               \
        for (; c < m; ++c) {                                                            \
            float col[8];                                                               \
            for (int u = 0; u < 8; ++u) {                                               \
                const int64_t e = (i + u) * m + c;                                      \
                float ch = 0.0f;                                                        \
                for (int64_t k = 0; k < r0; ++k) ch = __builtin_fmaf(pr[u * r0 + k], qt0[k * m + c], ch); \
                col[u] = out[e] = g[e] + (a[e] - ch);                                   \
            }                                                                           \
            const __m256 cv = _mm256_loadu_ps(col);                                     \
            MM_STEP(TERM, cv, c, R)                                                     \
        }                                                                               \
        if (m > 0) { MM_FOLD(R) }                                                       \
        MM_SEQ_STORE(R)                                                                 \
    }                                                                                   \
    if (stream) _mm_sfence();                                                           \
    *done = i;                                                                          \
}
#define OWED_MM_AVX2(R) OWED_ROWS_AVX2(R, owed_mm_avx2, MM_SEQ_TERM) OWED_ROWS_AVX2(R, owed_blk_avx2, MM_BLK_TERM)
OWED_MM_AVX2(1) OWED_MM_AVX2(2) OWED_MM_AVX2(3) OWED_MM_AVX2(4)
OWED_MM_AVX2(5) OWED_MM_AVX2(6) OWED_MM_AVX2(7) OWED_MM_AVX2(8)
#define OWED_MM_CALL(R) owed_mm_avx2_##R(p0, qt0, r0, a, g, n, m, out, Q, P, kc, &i)
#define OWED_BLK_CALL(R) owed_blk_avx2_##R(p0, qt0, r0, a, g, n, m, out, Q, P, kc, &i)
#endif
int ac_owed_mm(const float* p0, const float* qt0, int64_t r0, const float* a, const float* g, int64_t n, int64_t m,
               float* out, const float* Q, int64_t r, float* P, int64_t kc) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (r < 1 || r > 8 || !use_avx2() || !fma_hw()) return -1;
    if (kc) switch (r) { AC_RANK_CASES(OWED_BLK_CALL) default: return -1; }
    else switch (r) { AC_RANK_CASES(OWED_MM_CALL) default: return -1; }
    for (; i < n; ++i) {  /* the rows left: the scalar forms of both passes */
        const float* pi = p0 + i * r0;
        for (int64_t c = 0; c < m; ++c) {
            float ch = 0.0f;
            for (int64_t k = 0; k < r0; ++k) ch = __builtin_fmaf(pi[k], qt0[k * m + c], ch);
            out[i * m + c] = g[i * m + c] + (a[i * m + c] - ch);
        }
        for (int64_t j = 0; j < r; ++j) P[i * r + j] = seq_dot(out + i * m, 1, Q + j, r, m, kc);
    }
    return 0;
#else
    (void)p0; (void)qt0; (void)r0; (void)a; (void)g; (void)n; (void)m; (void)out; (void)Q; (void)r; (void)P; (void)i;
    (void)kc;
    return -1;
#endif
}
/* Random-k's sample: the first k distinct values of draws (each in [0, n)) in draw order, written
   ascending; returns how many distinct values were found (< k: every draw was used). A bitmap of
   n bits (zeroed by the caller) replaces torch.unique's sort. -1 on a draw outside [0, n). */
int64_t ac_first_distinct(const int64_t* draws, int64_t m, int64_t n, int64_t k, uint64_t* bitmap, int64_t* out) {
    int64_t c = 0;
    for (int64_t i = 0; i < m && c < k; ++i) {
        const int64_t d = draws[i];
        if (d < 0 || d >= n) return -1;
        const uint64_t bit = (uint64_t)1 << (d & 63);
        if (!(bitmap[d >> 6] & bit)) { bitmap[d >> 6] |= bit; ++c; }
    }
    int64_t w = 0;
    for (int64_t j = 0; j < (n + 63) / 64 && w < c; ++j) {
        uint64_t b = bitmap[j];
        while (b) { out[w++] = (j << 6) + __builtin_ctzll(b); b &= b - 1; }
    }
    return c;
}
/* Chunk-Top-k's quantizer (adacomp.compressors.chunktopk.quantize) over `rows` runs of k kept values:
   scale = max |v| of the run; code = clamp(round_half_even((v / safe + 1) * half), 0, top) with
   safe = scale > 0 ? scale : 1 and half = top / 2, torch's float32 operations in its order. Here
   |v| <= safe, so the product lies in [0, top] and adding and removing 2^23 rounds it half-even.
   -1 on a NaN or an infinity (torch answers). */
/* One value's code: the nearest level of its row's grid (torch's division, add, multiply and round
   half to even by 2^23, then the clamps), as an integer. */
static inline uint8_t quantize_code(float x, float safe, float half, float tf) {
    float t = x / safe;
    t = t + 1.0f;
    t = t * half;
    t = (t + 8388608.0f) - 8388608.0f;
    t = t < 0.0f ? 0.0f : (t > tf ? tf : t);
    return (uint8_t)(int)t;
}
#if defined(AC_AVX2)
/* One row of ac_chunk_quantize, 8 values a step (the same IEEE operations, the maximum exact in any
   order; the codes truncated and packed to bytes); the row's scale into *scale. -1 on a NaN or an
   infinity (nothing of this row written). */
__attribute__((target("avx2"))) static int chunk_quantize_row_avx2(const float* x, int64_t k, float half, float tf,
                                                                  float* scale, uint8_t* c) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + j), absm);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, a);
    }
    if (_mm256_movemask_ps(nan)) return -1;
    float l8[8], m = 0.0f;
    _mm256_storeu_ps(l8, mx);
    for (int q = 0; q < 8; ++q) m = l8[q] > m ? l8[q] : m;
    for (; j < k; ++j) {
        const float a = __builtin_fabsf(x[j]);
        if (a != a) return -1;
        m = a > m ? a : m;
    }
    if (m > 3.4028234663852886e38f) return -1;  /* an infinite value: inf / inf is torch's to round */
    *scale = m;
    const float safe = m > 0.0f ? m : 1.0f;
    const __m256 sv = _mm256_set1_ps(safe), one = _mm256_set1_ps(1.0f), hv = _mm256_set1_ps(half);
    const __m256 magic = _mm256_set1_ps(8388608.0f), zero = _mm256_setzero_ps(), topv = _mm256_set1_ps(tf);
    for (j = 0; j + 8 <= k; j += 8) {
        __m256 t = _mm256_mul_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(x + j), sv), one), hv);
        t = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
        const __m256 r = _mm256_blendv_ps(_mm256_blendv_ps(t, zero, _mm256_cmp_ps(t, zero, _CMP_LT_OQ)), topv,
                                          _mm256_cmp_ps(t, topv, _CMP_GT_OQ));
        const __m256i q = _mm256_cvttps_epi32(r);
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i*)(c + j), _mm_packus_epi16(w16, w16));
    }
    for (; j < k; ++j) c[j] = quantize_code(x[j], safe, half, tf);
    return 0;
}
#endif
int ac_chunk_quantize(const float* v, int64_t rows, int64_t k, int top, float* scales, uint8_t* codes) {
    const float half = (float)top / 2.0f, tf = (float)top;
#if defined(AC_AVX2)
    if (k >= 8 && use_avx2()) {
        for (int64_t row = 0; row < rows; ++row)
            if (chunk_quantize_row_avx2(v + row * k, k, half, tf, scales + row, codes + row * k) != 0) return -1;
        return 0;
    }
#endif
    for (int64_t row = 0; row < rows; ++row) {
        const float* x = v + row * k;
        float m = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const float a = __builtin_fabsf(x[j]);
            if (a != a) return -1;
            m = a > m ? a : m;
        }
        if (m > 3.4028234663852886e38f) return -1;  /* an infinite value: inf / inf is torch's to round */
        scales[row] = m;
        const float safe = m > 0.0f ? m : 1.0f;
        uint8_t* c = codes + row * k;
        for (int64_t j = 0; j < k; ++j) c[j] = quantize_code(x[j], safe, half, tf);
    }
    return 0;
}
/* Chunk-Top-k's rows [row0, row1) of one payload: positions (the int16 local index, its uint16
   pattern above 32767, + the chunk's start, relative to row0's chunk) and values (levels[code] * the
   chunk's scale); the count. Rows before the partial one keep k_row each, so row r's first kept
   value is the (r k_row)-th; b divides 8, so a code never straddles two bytes. */
#if defined(AC_AVX2)
/* The first values of one row of chunk_decode_rows, 8 a step (codes of b <= 4 bits: 8 of them read
   as one word from the byte the first starts in, while that word lies inside the nbytes of codes):
   levels[code] by a permutation, times the scale (the same product), positions widened from the int16
   indices. Returns how many it decoded. */
__attribute__((target("avx2"))) static int64_t chunk_decode_run_avx2(const int16_t* idx, const uint8_t* codes,
                                                                    int64_t bit0, int b, float s, const float* levels,
                                                                    int64_t m, int64_t base, int64_t nbytes,
                                                                    int64_t* pos, float* vals) {
    float lv[16] = {0};
    for (int q = 0; q < 1 << b; ++q) lv[q] = levels[q];
    const __m256 lo = _mm256_loadu_ps(lv), hi = _mm256_loadu_ps(lv + 8), sv = _mm256_set1_ps(s);
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(b));
    const __m256i cmask = _mm256_set1_epi32((1 << b) - 1), seven = _mm256_set1_epi32(7);
    const __m256i basev = _mm256_set1_epi64x(base);
    int64_t j = 0;
    for (; j + 8 <= m && ((bit0 + j * b) >> 3) + 8 <= nbytes; j += 8) {
        const int64_t bit = bit0 + j * b;
        uint64_t word;
        __builtin_memcpy(&word, codes + (bit >> 3), sizeof word);
        const __m256i c = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)(uint32_t)(word >> (bit & 7))), shifts), cmask);
        __m256 v = _mm256_permutevar8x32_ps(lo, c);
        if (b == 4) v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, c), _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, seven)));
        _mm256_storeu_ps(vals + j, _mm256_mul_ps(v, sv));
        const __m256i p32 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(idx + j)));
        _mm256_storeu_si256((__m256i*)(pos + j), _mm256_add_epi64(basev, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(p32))));
        _mm256_storeu_si256((__m256i*)(pos + j + 4),
                            _mm256_add_epi64(basev, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(p32, 1))));
    }
    return j;
}
#endif
static int64_t chunk_decode_rows(const int16_t* idx, const uint8_t* codes, int b, const float* scales,
                                 const float* levels, int64_t row0, int64_t row1, int64_t full, int64_t k_row,
                                 int64_t k_tail, int64_t chunk, int64_t* pos, float* vals) {
    const unsigned mask = (1u << b) - 1u;
    int64_t w = 0;
#if defined(AC_AVX2)
    const int vec = b <= 4 && use_avx2();
    const int64_t nbytes = ((full * k_row + k_tail) * b + 7) / 8;
#endif
    for (int64_t row = row0; row < row1 && row <= full; ++row) {
        const int64_t m = row < full ? k_row : k_tail, base = (row - row0) * chunk, i0 = row * k_row;
        const float s = m > 0 ? scales[row] : 0.0f;
        int64_t j0 = 0;
#if defined(AC_AVX2)
        if (vec && m >= 8)
            j0 = chunk_decode_run_avx2(idx + i0, codes, i0 * b, b, s, levels, m, base, nbytes, pos + w, vals + w);
#endif
        w += j0;
        for (int64_t i = i0 + j0; i < i0 + m; ++i, ++w) {
            const int64_t bit = i * b;
            vals[w] = levels[(codes[bit >> 3] >> (bit & 7)) & mask] * s;
            pos[w] = base + (int64_t)(uint16_t)idx[i];
        }
    }
    return w;
}
/* Chunk-Top-k's payload as flat positions and float32 values (adacomp.compressors.chunktopk's
   kept_positions / kept_values): position = the int16 local index (its uint16 pattern above 32767)
   + the chunk's start; value = levels[code] * the chunk's scale (one IEEE product), codes packed
   LSB-first at b bits. Rows 0 .. full - 1 keep k_row values, then k_tail in the partial chunk.
   Returns 1 when a value is -0.0 (the caller's sum from a +0 start would lose that sign), else 0. */
int ac_chunk_decode(const int16_t* idx, const uint8_t* codes, int b, const float* scales, const float* levels,
                    int64_t full, int64_t k_row, int64_t k_tail, int64_t chunk, int64_t* pos, float* vals) {
    const int64_t kept = chunk_decode_rows(idx, codes, b, scales, levels, 0, full + 1, full, k_row, k_tail, chunk,
                                           pos, vals);
    uint32_t negzero = 0;
    for (int64_t i = 0; i < kept; ++i) {
        uint32_t u;
        __builtin_memcpy(&u, vals + i, sizeof u);
        negzero |= u == 0x80000000u;
    }
    return negzero != 0;
}
/* Chunk-Top-k's mean over the ranks' payloads straight from their codes: ac_sparse_mean of what
   ac_chunk_decode gives each rank, slab by slab (`slab` chunks: each rank's decoded slab, positions
   and values, stays in cache for the mean that reads it) instead of every rank's int64 positions and
   float32 values written whole and read back (12 bytes a kept value against the payload's ~2.3).
   The same sums in the same order, so the same bits. -1 (nothing written) where a chunk's scale is
   +-0 or subnormal (a value could be -0.0, whose sign a sum from +0 loses: the caller's path), -2
   where a payload's positions do not ascend inside [0, n) (out partly written: the caller's path
   writes it whole). pos / vals: world * (slab k_row + k_tail) of scratch; iptr, vptr, counts, at:
   world pointers / counts. */
int ac_chunk_mean(float* out, int64_t n, int world, const int16_t* const* idx, const uint8_t* const* codes,
                  const float* const* scales, int b, const float* levels, int64_t full, int64_t k_row,
                  int64_t k_tail, int64_t chunk, float divisor, int64_t slab, int64_t* pos, float* vals,
                  const int64_t** iptr, const float** vptr, int64_t* counts, int64_t* at) {
    const int64_t rows = full + (k_tail > 0), cap = slab * k_row + k_tail;
    for (int r = 0; r < world; ++r)
        for (int64_t row = 0; row < rows; ++row) {
            const float s = scales[r][row];
            if (s == s && !(__builtin_fabsf(s) >= 1.17549435e-38f)) return -1;  /* FLT_MIN */
        }
    for (int64_t r0 = 0; r0 < rows; r0 += slab) {
        const int64_t r1 = r0 + slab < rows ? r0 + slab : rows, lo = r0 * chunk;
        const int64_t hi = r1 * chunk < n ? r1 * chunk : n;
        for (int r = 0; r < world; ++r) {
            iptr[r] = pos + r * cap;
            vptr[r] = vals + r * cap;
            counts[r] = chunk_decode_rows(idx[r], codes[r], b, scales[r], levels, r0, r1, full, k_row, k_tail, chunk,
                                          pos + r * cap, vals + r * cap);
        }
        if (ac_sparse_mean(out + lo, hi - lo, world, iptr, vptr, counts, at, divisor) != 0) return -2;
    }
    return 0;
}
/* ac_chunk_mean for m Chunk-Top-k entries in one call, their payloads read where they lie in the
   gathered bytes at base: rank r's packed codes, float32 scales and int16 positions of entry i at byte
   code_off / scale_off / idx_off[i * world + r]; the layout of entry i in bits .. chunk[i] and its
   slab[i] (per-entry calls from Python cost ~40 us a tensor, more than the C work on small tensors).
   status[i]: ac_chunk_mean's result. ip, cp, sp: world pointers of scratch; the rest as ac_chunk_mean's,
   pos / vals sized for the largest entry. */
void ac_chunk_mean_many(int64_t m, float* const* outs, const int64_t* ns, int world, const uint8_t* base,
                        const int64_t* code_off, const int64_t* scale_off, const int64_t* idx_off,
                        const int32_t* bits, const float* const* levels, const int64_t* full, const int64_t* k_row,
                        const int64_t* k_tail, const int64_t* chunk, const int64_t* slab, float divisor,
                        const int16_t** ip, const uint8_t** cp, const float** sp, int64_t* pos, float* vals,
                        const int64_t** iptr, const float** vptr, int64_t* counts, int64_t* at, int32_t* status) {
    for (int64_t i = 0; i < m; ++i) {
        for (int r = 0; r < world; ++r) {
            ip[r] = (const int16_t*)(base + idx_off[i * world + r]);
            cp[r] = base + code_off[i * world + r];
            sp[r] = (const float*)(base + scale_off[i * world + r]);
        }
        status[i] = ac_chunk_mean(outs[i], ns[i], world, ip, cp, sp, bits[i], levels[i], full[i], k_row[i], k_tail[i],
                                  chunk[i], divisor, slab[i], pos, vals, iptr, vptr, counts, at);
    }
}
/* The sparse residuals below write at positions of a buffer the compensation has just streamed
   past the caches, so each position is a miss: the line ZERO_AHEAD positions ahead is prefetched
   for writing (cost_notes item 44). */
#define ZERO_AHEAD 64
/* out[idx[i]] = t[idx[i]] - v[i]: error feedback's residual where a payload changed only those
   positions (out == t allowed). -1 (nothing written) when a position lies outside [0, n). */
int ac_sub_at(float* out, const float* t, int64_t n, const int64_t* idx, const float* v, int64_t m) {
    for (int64_t i = 0; i < m; ++i) if ((uint64_t)idx[i] >= (uint64_t)n) return -1;
    int64_t i = 0;
    for (; i + ZERO_AHEAD < m; ++i) {
        __builtin_prefetch(out + idx[i + ZERO_AHEAD], 1, 0);
        if (t != out) __builtin_prefetch(t + idx[i + ZERO_AHEAD], 0, 0);
        out[idx[i]] = t[idx[i]] - v[i];
    }
    for (; i < m; ++i) out[idx[i]] = t[idx[i]] - v[i];
    return 0;
}
/* out[idx[i]] = +0.0 (index_fill_ with 0): error feedback's residual of an exact-value sparse payload.
   -1 (nothing written) when a position lies outside [0, n). */
int ac_zero_at(float* out, int64_t n, const int64_t* idx, int64_t m) {
    for (int64_t i = 0; i < m; ++i) if ((uint64_t)idx[i] >= (uint64_t)n) return -1;
    int64_t i = 0;
    for (; i + ZERO_AHEAD < m; ++i) {
        __builtin_prefetch(out + idx[i + ZERO_AHEAD], 1, 0);
        out[idx[i]] = 0.0f;
    }
    for (; i < m; ++i) out[idx[i]] = 0.0f;
    return 0;
}
/* out[i] = x[idx[i]] (index_select): a sparse payload's values. Ascending positions ~100 apart
   (1 % density) miss the cache one by one; the loads are prefetched TAKE_AHEAD positions ahead
   into every cache level (VGG-16's fc6 at 1 %: 8.6 ms with torch's gather, 4.5 ms here on the
   EPYC; on the Xeon 2^20 ascending positions over 2^27 floats 10.7 ms with 256 ahead and the
   non-temporal hint, 6.6 ms with 128 and this one). -1 on a position outside [0, n) (out partly
   written: the caller's torch call raises). */
#define TAKE_AHEAD 128
int ac_take(const float* x, int64_t n, const int64_t* idx, int64_t m, float* out) {
    int64_t i = 0;
    for (; i + TAKE_AHEAD < m; ++i) {
        const uint64_t p = (uint64_t)idx[i + TAKE_AHEAD];
        if (p < (uint64_t)n) __builtin_prefetch(x + p, 0, 3);
        if ((uint64_t)idx[i] >= (uint64_t)n) return -1;
        out[i] = x[idx[i]];
    }
    for (; i < m; ++i) {
        if ((uint64_t)idx[i] >= (uint64_t)n) return -1;
        out[i] = x[idx[i]];
    }
    return 0;
}
/* The values of x at the positions idx (any order, repeats kept), in an order of their own: the
   positions grouped by their 2^shift-element region (a count and a scatter into pos)
   and read region by region with the loads prefetched, so a random sample's reads stay within a
   few pages at a time (DGC's threshold sample: 2^20 random positions over 2^27 floats 20-29 ms in
   draw order on the Xeon, every read a page walk). The values are the same multiset as
   index_select's, which is all an order statistic reads. counts: (n >> shift) + 2
   int64, pos: m int64. -1 on a position outside [0, n) (nothing read). */
int ac_take_grouped(const float* x, int64_t n, const int64_t* idx, int64_t m, int shift, int64_t* counts,
                    int64_t* pos, float* out) {
    const int64_t groups = (n >> shift) + 1;
    for (int64_t b = 0; b <= groups; ++b) counts[b] = 0;
    for (int64_t i = 0; i < m; ++i) {
        if ((uint64_t)idx[i] >= (uint64_t)n) return -1;
        ++counts[(idx[i] >> shift) + 1];
    }
    for (int64_t b = 1; b <= groups; ++b) counts[b] += counts[b - 1];  /* counts[b]: group b's start */
    for (int64_t i = 0; i < m; ++i) pos[counts[idx[i] >> shift]++] = idx[i];
    return ac_take(x, n, pos, m, out);
}
/* float32 -> bfloat16 with the rounding of torch's vectorised conversion of a contiguous tensor
   (round to nearest even; every NaN to 0xffff, where torch's scalar path writes 0x7fc0) and back
   (the upper 16 bits, exact). The module checks the first against torch once per process (a torch
   built to convert otherwise keeps its own). */
#if defined(AC_AVX2)
/* 16 values a step: the rounding on 8-lane vectors, NaN lanes blended to 0xffff, and packus to 16
   bits (every 32-bit result is below 2^16, so its unsigned saturation changes nothing; it interleaves
   the two vectors' 128-bit halves, which permute4x64 puts back in order). Streamed where the output is
   large and 32-byte aligned: 3 x 2^25 floats 101 -> 51 ms on the 2-core Xeon, whose read-write floor
   over the same floats took 68 ms (cost_notes item 45). */
__attribute__((target("avx2"))) static inline __m256i bf16_round_avx2(__m256i u) {
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), nan);
}
__attribute__((target("avx2"))) static int64_t to_bf16_avx2(const uint32_t* x, uint16_t* out, int64_t n) {
    const int stream = n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        AC_AHEAD(x, i, 1);
        const __m256i a = bf16_round_avx2(_mm256_loadu_si256((const __m256i*)(x + i)));
        const __m256i b = bf16_round_avx2(_mm256_loadu_si256((const __m256i*)(x + i + 8)));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        if (stream) _mm256_stream_si256((__m256i*)(out + i), p); else _mm256_storeu_si256((__m256i*)(out + i), p);
    }
    if (stream) _mm_sfence();
    return i;
}
/* The 16 bits shifted up, 8 a step, streamed as above (3 x 2^25 values 79 -> 34 ms there). */
__attribute__((target("avx2"))) static int64_t from_bf16_avx2(const uint16_t* x, uint32_t* out, int64_t n) {
    const int stream = n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + i))), 16);
        if (stream) _mm256_stream_si256((__m256i*)(out + i), v); else _mm256_storeu_si256((__m256i*)(out + i), v);
    }
    if (stream) _mm_sfence();
    return i;
}
#endif
void ac_to_bf16(const uint32_t* x, uint16_t* out, int64_t n) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (use_avx2()) i = to_bf16_avx2(x, out, n);
#endif
#if defined(__SSE2__)
    const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff), qnan = _mm_set1_epi32(0xffff);
    const __m128i absmask = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
        __m128i h[2];
        for (int q = 0; q < 2; ++q) {
            const __m128i u = _mm_loadu_si128((const __m128i*)(x + i + 4 * q));
            const __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(_mm_and_si128(_mm_srli_epi32(u, 16), one), bias)), 16);
            const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, absmask), inf);
            h[q] = _mm_or_si128(_mm_and_si128(nan, qnan), _mm_andnot_si128(nan, r));
        }
        /* pack 8 values of 16 bits (each < 2^16) without the signed saturation of packs */
        __m128i lo = _mm_shufflelo_epi16(h[0], 0xd8), hi = _mm_shufflelo_epi16(h[1], 0xd8);
        lo = _mm_shufflehi_epi16(lo, 0xd8); hi = _mm_shufflehi_epi16(hi, 0xd8);
        lo = _mm_shuffle_epi32(lo, 0xd8); hi = _mm_shuffle_epi32(hi, 0xd8);
        _mm_storeu_si128((__m128i*)(out + i), _mm_unpacklo_epi64(lo, hi));
    }
#endif
    for (; i < n; ++i) {
        const uint32_t u = x[i];
        out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0xffff : (uint16_t)((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);
    }
}
void ac_from_bf16(const uint16_t* x, uint32_t* out, int64_t n) {
    int64_t i = 0;
#if defined(AC_AVX2)
    if (use_avx2()) i = from_bf16_avx2(x, out, n);
#endif
    for (; i < n; ++i) out[i] = (uint32_t)x[i] << 16;
}
/* Bit packing, the layout of adacomp.compressors._bitpack: code i at stream bits [i b, (i+1) b),
   LSB first; the last byte zero-padded. b is 1, 2 or 4; codes are below 2^b. */
#define PACK_LOOP(B)                                                                    \
    for (j = 0; j < full; ++j) {                                                        \
        const uint8_t* c = codes + j * (8 / (B));                                       \
        unsigned v = 0;                                                                 \
        for (int t = 0; t < 8 / (B); ++t) v |= (unsigned)c[t] << ((B) * t);             \
        out[j] = (uint8_t)v;                                                            \
    }
AC_CLONES void ac_pack(const uint8_t* codes, int64_t n, int b, uint8_t* out) {
    int per = 8 / b;
    int64_t full = n / per, j;
    switch (b) {  /* constant widths: the loops unroll and vectorise */
    case 1: PACK_LOOP(1); break;
    case 2: PACK_LOOP(2); break;
    default: PACK_LOOP(4); break;
    }
    if (full * per < n) {
        unsigned v = 0;
        for (int t = 0; full * per + t < n; ++t) v |= (unsigned)codes[full * per + t] << (b * t);
        out[full] = (uint8_t)v;
    }
}
/* Chunk-Top-k's payload of one run of `rows` chunks, k kept in each (their in-chunk positions and
   values as ac_chunk_topk gives them), in one call: ac_chunk_quantize's scales and codes (into
   scratch, rows * k bytes), the codes packed LSB-first from code number `first` of the payload's
   stream (ac_pack's bytes; b divides 8, so the run's first codes finish the byte a previous run
   began, whose higher bits ac_pack left zero) and the positions as int16 (their uint16 pattern
   above 32767). -1 (codes and positions not written) where ac_chunk_quantize refuses: torch's path. */
int ac_chunk_encode(const int64_t* pos, const float* vals, int64_t rows, int64_t k, int b, int64_t first,
                    uint8_t* scratch, float* scales, uint8_t* packed, int16_t* idx) {
    if (ac_chunk_quantize(vals, rows, k, (1 << b) - 1, scales, scratch) != 0) return -1;
    const int64_t n = rows * k, per = 8 / b;
    for (int64_t i = 0; i < n; ++i) idx[i] = (int16_t)(uint16_t)pos[i];
    int64_t lead = (per - first % per) % per;
    if (lead > n) lead = n;
    for (int64_t i = 0; i < lead; ++i) {
        const int64_t bit = (first + i) * b;
        packed[bit >> 3] |= (uint8_t)(scratch[i] << (bit & 7));
    }
    if (n > lead) ac_pack(scratch + lead, n - lead, b, packed + (((first + lead) * b) >> 3));
    return 0;
}
void ac_unpack(const uint8_t* packed, int64_t n, int b, uint8_t* out) {
    int per = 8 / b;
    unsigned mask = (1u << b) - 1u;
    int64_t full = n / per, j;
    for (j = 0; j < full; ++j) {
        unsigned v = packed[j];
        for (int t = 0; t < per; ++t) out[j * per + t] = (uint8_t)((v >> (b * t)) & mask);
    }
    for (int64_t i = full * per; i < n; ++i) out[i] = (uint8_t)((packed[full] >> (b * (i - full * per))) & mask);
}
/* 1-bit codes of x >= 0 (NaN: 0), packed: one read of x, no bool mask. */
AC_CLONES void ac_pack_nonneg(const float* x, int64_t n, uint8_t* out) {
    int64_t full = n / 8, j;
    for (j = 0; j < full; ++j) {
        const float* v = x + 8 * j;
        unsigned b = 0;
        for (int t = 0; t < 8; ++t) b |= (unsigned)(v[t] >= 0.0f) << t;
        out[j] = (uint8_t)b;
    }
    if (full * 8 < n) {
        unsigned b = 0;
        for (int t = 0; full * 8 + t < n; ++t) b |= (unsigned)(x[full * 8 + t] >= 0.0f) << t;
        out[full] = (uint8_t)b;
    }
}
/* out[i] = table[code i] for float32 tables of 2^b entries (a byte-table decode without the table). */
AC_CLONES void ac_decode(const uint8_t* packed, int64_t n, int b, const float* values, float* out) {
    int per = 8 / b;
    unsigned mask = (1u << b) - 1u;
    int64_t full = n / per, j;
    for (j = 0; j < full; ++j) {
        unsigned v = packed[j];
        for (int t = 0; t < per; ++t) out[j * per + t] = values[(v >> (b * t)) & mask];
    }
    for (int64_t i = full * per; i < n; ++i) out[i] = values[(packed[full] >> (b * (i - full * per))) & mask];
}
COUNT(ac_count_ge, v >= t)
COUNT(ac_count_gt, v > t)
COUNT(ac_count_not_lt, !(v < t))
COUNT_T(ac_count_abs_ge, v >= t, __builtin_fabsf)
COUNT_T(ac_count_abs_gt, v > t, __builtin_fabsf)
COUNT_T(ac_count_abs_not_lt, !(v < t), __builtin_fabsf)
/* The count of a threshold search's mode (0 gt, 1 ge, 2 abs_gt, 3 abs_ge: _BAND_MODES). */
static int64_t (*ac_count_fn(int mode))(const float*, int64_t, float) {
    return mode == 0 ? ac_count_gt : mode == 1 ? ac_count_ge : mode == 2 ? ac_count_abs_gt : ac_count_abs_ge;
}
/* RedSync's ratio bisection (RedSyncCompressor.threshold) where every count is a pass over the whole
   of a (no kept candidates: tensors below the compaction size), in one call instead of a Python step
   and a call a count. mode: 0 gt, 1 ge, 2 abs_gt, 3 abs_ge (the counter's). The count at the mean
   picks the searched segment (base, span); each step's threshold is formed in double as Python forms
   it (base + mid * span; no contraction) and counted as float32, as the count calls' argument is.
   thrs / counts get each step's threshold and count; returns the number of steps, and *found whether
   the last one landed in [k, 2k) (else the caller picks the best of them, as the Python loop does). */
int64_t ac_bisect_band(const float* a, int64_t n, int mode, int64_t k, double mean, double top, int64_t max_steps,
                       double* thrs, int64_t* counts, int* found) {
    int64_t (*cnt)(const float*, int64_t, float) = ac_count_fn(mode);
    double base = mean, span = top - mean, lo = 0.0, hi = 1.0;
    *found = 0;
    if (cnt(a, n, (float)mean) < k) { base = 0.0; span = mean; }
    for (int64_t step = 0; step < max_steps; ++step) {
        const double mid = 0.5 * (lo + hi), thr = base + mid * span;
        const int64_t c = cnt(a, n, (float)thr);
        thrs[step] = thr;
        counts[step] = c;
        if (k <= c && c < 2 * k) { *found = 1; return step + 1; }
        if (c < k) hi = mid; else lo = mid;
    }
    return max_steps;
}
/* Gaussian-k's bounded correction loop (gaussiank.adjust), from the threshold st[0] with no bracket
   yet: count thr; inside [lo, hi] stop; else up by 1.5x (too many) or down
   by 2x (too few) until the count has been on both sides, then the geometric mean of the two nearest
   thresholds; at most max_adjust steps. The counts: with a kept set (has_floor: the kept signed values
   kept[0..m) passing the floor, counted by kept_mode), over it from the floor up, and at or below the
   floor the kept set's size where that exceeds hi (no read; ThresholdCounter.lower_bound); a count
   below the floor otherwise stops the loop before that step, for the caller's counter (flags[2] = 0);
   without one, full counts of a (mode as ac_bisect_band's). The same doubles as the Python loop: each
   threshold rounded to float32 for its count as ctypes rounds it, IEEE products and square roots (no
   contraction). Returns the steps made; on return st = {thr, low, high} and flags = {has_low,
   has_high, 1 where the loop ended (inside the band or out of steps), the counts read}. */
int64_t ac_gauss_band(const float* a, int64_t n, int mode, const float* kept, int64_t m, int kept_mode, double floor,
                      int has_floor, double* st, int* flags, double lo, double hi, int64_t max_adjust) {
    int64_t (*full)(const float*, int64_t, float) = ac_count_fn(mode);
    int64_t (*part)(const float*, int64_t, float) = ac_count_fn(kept_mode);
    double thr = st[0], low = 0.0, high = 0.0;
    int has_low = 0, has_high = 0, reads = 0, done = 1;
    int64_t step = 0;
    while (step < max_adjust) {
        double c;
        if (!has_floor) { c = (double)full(a, n, (float)thr); ++reads; }
        else if (thr <= floor && (double)m > hi) c = (double)m;
        else if (thr >= floor) { c = (double)part(kept, m, (float)thr); ++reads; }
        else { done = 0; break; }
        ++step;
        if (lo <= c && c <= hi) break;
        if (c > hi) {
            const double next = has_high ? __builtin_sqrt(thr * high) : thr * 1.5;
            low = thr;
            has_low = 1;
            thr = next;
        } else {
            const double next = has_low ? __builtin_sqrt(thr * low) : thr * 0.5;
            high = thr;
            has_high = 1;
            thr = next;
        }
    }
    st[0] = thr; st[1] = low; st[2] = high;
    flags[0] = has_low; flags[1] = has_high; flags[2] = done; flags[3] = reads;
    return step;
}
/* Gaussian-k's choice from the candidates its compensation kept (GaussianKCompressor.choose with a
   kept set: the signed values kept[0..m) at positions kidx, all with |x| > floor), given torch's mean
   and std: the threshold mean + std * z in double, the correction loop over the kept set
   (ac_gauss_band with the floor), the candidates passing it (ac_pick_pairs, strict, into sel_idx /
   sel_vals, room for m), and where more than cap (> 0) pass, the cap largest (ac_pick_largest into
   out_idx / out_vals, room for cap; keys: m uint32 of scratch). The same calls with the same
   arguments as the Python path (~30 us of Python a tensor between four calls). Returns how many are
   selected, *truncated = 1 where they are in out_*; -1 where the Python path must answer: a
   threshold that is not finite and positive, a loop that needs a count below the floor, a threshold
   below the floor (a full pass), a NaN in the pick. */
int64_t ac_gauss_kept(const float* x, int64_t n, const float* kept, const int64_t* kidx, int64_t m, double floor,
                      double mean, double std, double z, double lo, double hi, int64_t max_adjust, int64_t cap,
                      int64_t* sel_idx, float* sel_vals, uint32_t* keys, int64_t* out_idx, float* out_vals,
                      int* truncated) {
    double st[3];
    int flags[4];
    *truncated = 0;
    double thr = mean + std * z;
    if (!__builtin_isfinite(thr) || thr <= 0.0) return -1;
    if (max_adjust >= 1) {
        st[0] = thr;
        ac_gauss_band(x, n, 2, kept, m, 2, floor, 1, st, flags, lo, hi, max_adjust);
        if (!flags[2]) return -1;
        thr = st[0];
    }
    if (!(thr >= floor)) return -1;
    const int64_t c = ac_pick_pairs(kept, kidx, m, (float)thr, 1, sel_idx, sel_vals, m);
    if (cap <= 0 || c <= cap) return c;
    if (ac_pick_largest(sel_vals, sel_idx, c, cap, NULL, keys, out_idx, out_vals) != 0) return -1;
    *truncated = 1;
    return cap;
}
/* Gaussian-k's whole choice (GaussianKCompressor.choose) for a tensor its search counts whole (below
   the compaction size, mean from the compensation, one thread), in one call instead of four and the
   Python between them (~35 us a tensor; ResNet-50 has 34 such tensors a step): torch.std's float32
   from its in-order sum of squared deviations (ac_sumsq_select_abs_gt as std_in_order calls it), the
   threshold mean + std * z in double, the correction loop over full counts (ac_gauss_band), the
   positions and signed values of |x| > thr (ac_select_abs_gt_signed into sel_idx / sel_vals, room for
   n), and where more than cap (> 0) pass, the cap largest (ac_pick_largest into out_idx / out_vals,
   room for cap; keys: n uint32 of scratch). The same calls with the same arguments as the Python path,
   so the same bits. Returns how many are selected, *truncated = 1 where they are in out_*; -1 where
   the Python path must answer (a threshold that is not finite and positive: its fallback reads the
   maximum; a NaN in the pick). */
int64_t ac_gauss_whole(const float* x, int64_t n, double mean, double z, double lo, double hi, int64_t max_adjust,
                       int64_t cap, int64_t* sel_idx, float* sel_vals, uint32_t* keys, int64_t* out_idx,
                       float* out_vals, int* truncated) {
    double sumsq = 0.0, st[3];
    int used = 0, flags[4];
    *truncated = 0;
    if (n < 2) return -1;
    ac_sumsq_select_abs_gt(x, n, mean, __builtin_inff(), NULL, NULL, 0, &sumsq, 0, &used);
    const double var = sumsq / (double)(n - 1);
    if (!(var >= 0.0)) return -1;
    const double std = (double)(float)__builtin_sqrt(var);
    double thr = mean + std * z;
    if (!__builtin_isfinite(thr) || thr <= 0.0) return -1;
    if (max_adjust >= 1) {
        st[0] = thr;
        ac_gauss_band(x, n, 2, x, n, 2, 0.0, 0, st, flags, lo, hi, max_adjust);
        thr = st[0];
    }
    const int64_t c = ac_select_abs_gt_signed(x, n, (float)thr, sel_idx, sel_vals, n);
    if (cap <= 0 || c <= cap) return c;
    if (ac_pick_largest(sel_vals, sel_idx, c, cap, NULL, keys, out_idx, out_vals) != 0) return -1;
    *truncated = 1;
    return cap;
}
/* QSGD's stochastic rounding of one block, torch's sequence of float32 operations per element:
   a = |x| / norm(bucket); a = a * s; a = a + u; a = floor(a); a = min(a, s); code = copysign(a, x)
   + s, as uint8. Element i belongs to bucket (off0 + i) / size of safe[]. Each step rounds once
   (no contraction), as torch's elementwise kernels do. a >= 0 here, so floor is a truncation below
   2^23 (every float from 2^23 up is an integer already): no libm call, and the loop vectorises.
   Returns -1 when a NaN occurred (torch's float-to-uint8 conversion of NaN is not defined): the
   caller then runs torch's operations on the block. */
static inline int qsgd_one(float v, float u, float d, float s, uint8_t* code) {
    float a = __builtin_fabsf(v) / d;
    a = a * s;
    a = a + u;
    a = a < 8388608.0f ? (float)(int32_t)a : a;
    a = a > s ? s : a;
    if (a != a) return 1;
    a = __builtin_copysignf(a, v) + s;
    *code = (uint8_t)(int32_t)a;
    return 0;
}
/* qsgd_one's operations 8 lanes at a time with AVX2 (picked at run time; the SSE2 loop below is the
   same operations 4 lanes at a time): codes for [i, end) of one bucket, from i in steps of 8;
   returns the next i and sets *nan when a lane went NaN. */
#if defined(AC_AVX2)
__attribute__((target("avx2"))) static int64_t qsgd_codes_avx2(const float* x, const float* rnd, int64_t i,
                                                               int64_t end, float d, float s, uint8_t* codes,
                                                               int* nan) {
    /* a >= +0 (or NaN) after the add, so truncation (vroundps) is the floor, min(s, a) keeps a NaN
       for the flag below, and a's sign bit is clear before v's is or-ed in */
    const __m256 dv = _mm256_set1_ps(d), sv = _mm256_set1_ps(s);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 bad = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        __m256 a = _mm256_div_ps(_mm256_andnot_ps(sign, v), dv);
        a = _mm256_mul_ps(a, sv);
        a = _mm256_add_ps(a, _mm256_loadu_ps(rnd + i));
        a = _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        a = _mm256_min_ps(sv, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        a = _mm256_add_ps(_mm256_or_ps(a, _mm256_and_ps(sign, v)), sv);
        const __m256i c = _mm256_cvttps_epi32(a);
        __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        p = _mm_packus_epi16(p, p);
        _mm_storel_epi64((__m128i*)(codes + i), p);
    }
    *nan |= _mm256_movemask_ps(bad);
    return i;
}
#endif
int ac_qsgd_codes(const float* x, int64_t m, const float* rnd, const float* safe, int64_t off0, int64_t size,
                  float s, uint8_t* codes) {
    int bad = 0;
    int64_t i = 0;
#if defined(AC_AVX2)
    const int avx2 = use_avx2();
#endif
    while (i < m) {
        int64_t b = (off0 + i) / size;
        int64_t end = (b + 1) * size - off0;
        if (end > m) end = m;
        const float d = safe[b];
#if defined(AC_AVX2)
        if (avx2) i = qsgd_codes_avx2(x, rnd, i, end, d, s, codes, &bad);
#endif
#if defined(__SSE2__)
        /* the same operations, 4 lanes at a time: the blends are bit masks, truncation of a NaN or
           of a >= 2^23 gives the "integer indefinite" value, which the blend then drops */
        const __m128 dv = _mm_set1_ps(d), sv = _mm_set1_ps(s), big = _mm_set1_ps(8388608.0f);
        const __m128 sign = _mm_set1_ps(-0.0f);
        __m128 nan = _mm_setzero_ps();
        for (; i + 4 <= end; i += 4) {
            __m128 v = _mm_loadu_ps(x + i);
            __m128 a = _mm_div_ps(_mm_andnot_ps(sign, v), dv);
            a = _mm_mul_ps(a, sv);
            a = _mm_add_ps(a, _mm_loadu_ps(rnd + i));
            __m128 small = _mm_cmplt_ps(a, big);
            a = _mm_or_ps(_mm_and_ps(small, _mm_cvtepi32_ps(_mm_cvttps_epi32(a))), _mm_andnot_ps(small, a));
            __m128 over = _mm_cmpgt_ps(a, sv);
            a = _mm_or_ps(_mm_and_ps(over, sv), _mm_andnot_ps(over, a));
            nan = _mm_or_ps(nan, _mm_cmpunord_ps(a, a));
            a = _mm_add_ps(_mm_or_ps(_mm_andnot_ps(sign, a), _mm_and_ps(sign, v)), sv);
            __m128i c = _mm_cvttps_epi32(a);
            c = _mm_packs_epi32(c, c);
            c = _mm_packus_epi16(c, c);
            int32_t four = _mm_cvtsi128_si32(c);
            __builtin_memcpy(codes + i, &four, 4);
        }
        bad |= _mm_movemask_ps(nan);
#endif
        for (; i < end; ++i) bad |= qsgd_one(x[i], rnd[i], d, s, codes + i);
    }
    return bad ? -1 : 0;
}
/* The mean over ranks of table-decoded codes: out[i] = (t_0 + t_1 [+ t_2 ...]) / world, t_r =
   tables[r][bucket * 2^bits + code_r(i)]; the tables hold each rank's decoded value of every code
   per bucket (QSGD: (code - s) * unit, EF-SignSGD: -scale / +scale), so this is the quantisers'
   decompress followed by the communicator's sum in rank order and division, each rounded once.
   Codes of 1, 2 or 4 bits never straddle a byte. A bucket at a time: its outputs stay in cache. */
#define TABLE_BYTES(B)                                                                          \
    if (r == 0) {                                                                               \
        for (; i < whole; i += 8 / (B)) {                                                       \
            const unsigned byte = pk[(i * (B)) >> 3];                                           \
            for (int k = 0; k < 8 / (B); ++k) out[i + k] = tab[(byte >> (k * (B))) & mask];     \
        }                                                                                       \
    } else {                                                                                    \
        for (; i < whole; i += 8 / (B)) {                                                       \
            const unsigned byte = pk[(i * (B)) >> 3];                                           \
            for (int k = 0; k < 8 / (B); ++k) out[i + k] = out[i + k] + tab[(byte >> (k * (B))) & mask]; \
        }                                                                                       \
    }
/* Each bucket is worked in runs of TABLE_RUN elements: every rank's codes are added into the run
   and the run is divided while it is still in L1, so the output goes to memory once instead of
   once per rank plus once for the division. A power-of-two world multiplies by its exact inverse
   (x * 2^-m is x / 2^m, rounded alike). A bucket of >= TABLE_BYTE_MIN bytes first expands each
   rank's table to one of whole bytes (256 x 8 / bits values), so a byte decodes as one short vector
   copy or add instead of 8 / bits lookups (EF-SignSGD's one bucket per tensor); the values and
   their order of addition are the same. */
#define TABLE_RUN 2048
#define TABLE_BYTE_MIN 4096
/* one byte's values as one vector copy (first rank) or add (later ranks); VT holds 8 / B floats */
#define BYTE_TABLE(B, VT)                                                                       \
    if (r == 0) {                                                                               \
        for (; i < whole; i += 8 / (B)) {                                                       \
            VT v;                                                                               \
            __builtin_memcpy(&v, tr + pk[(i * (B)) >> 3] * (8 / (B)), sizeof v);               \
            __builtin_memcpy(out + i, &v, sizeof v);                                            \
        }                                                                                       \
    } else {                                                                                    \
        for (; i < whole; i += 8 / (B)) {                                                       \
            VT v, o;                                                                            \
            __builtin_memcpy(&v, tr + pk[(i * (B)) >> 3] * (8 / (B)), sizeof v);               \
            __builtin_memcpy(&o, out + i, sizeof o);                                            \
            o = o + v;                                                                          \
            __builtin_memcpy(out + i, &o, sizeof o);                                            \
        }                                                                                       \
    }
typedef float ac_v8f __attribute__((vector_size(32)));
typedef float ac_v4f __attribute__((vector_size(16)));
typedef float ac_v2f __attribute__((vector_size(8)));
/* 4-bit codes through a 16-entry table, 8 at a time with AVX2 (the baseline build runs the scalar
   loop): each code picks its value from the table's two halves by a lane permute and a blend on the
   code's high bit; the first rank stores, later ranks add (out + value, one IEEE add per lane, the
   scalar loop's operation and operand order). pk points at the group's first byte. */
#if defined(AC_AVX2)
/* The values of one group of 8 codes: 4-bit codes from the 4 bytes at pk through the table halves
   lo / hi, 1-bit codes from the byte b through t0 / t1. */
__attribute__((target("avx2"))) static inline __m256 decode4_avx2(const uint8_t* pk, __m256 lo, __m256 hi) {
    uint32_t w;
    __builtin_memcpy(&w, pk, sizeof w);
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                                            _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                          _mm256_set1_epi32(15));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, code), _mm256_permutevar8x32_ps(hi, code),
                            _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}
__attribute__((target("avx2"))) static inline __m256 decode1_avx2(uint8_t b, __m256 t0, __m256 t1) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(b), bit), bit);
    return _mm256_blendv_ps(t0, t1, _mm256_castsi256_ps(on));
}
__attribute__((target("avx2"))) static void table4_avx2(const uint8_t* pk, const float* tab, float* out,
                                                        int64_t groups, int first) {
    const __m256 lo = _mm256_loadu_ps(tab), hi = _mm256_loadu_ps(tab + 8);
    for (int64_t g = 0; g < groups; ++g) {
        const __m256 v = decode4_avx2(pk + 4 * g, lo, hi);
        if (first) _mm256_storeu_ps(out + 8 * g, v);
        else _mm256_storeu_ps(out + 8 * g, _mm256_add_ps(_mm256_loadu_ps(out + 8 * g), v));
    }
}
/* 1-bit codes through a 2-entry table, a byte (8 codes) at a time with AVX2: each lane tests its
   bit and blends the two values; stores (first rank) or adds (out + value, as the scalar loop). */
__attribute__((target("avx2"))) static void table1_avx2(const uint8_t* pk, const float* tab, float* out,
                                                        int64_t bytes, int first) {
    const __m256 t0 = _mm256_set1_ps(tab[0]), t1 = _mm256_set1_ps(tab[1]);
    for (int64_t j = 0; j < bytes; ++j) {
        const __m256 v = decode1_avx2(pk[j], t0, t1);
        if (first) _mm256_storeu_ps(out + 8 * j, v);
        else _mm256_storeu_ps(out + 8 * j, _mm256_add_ps(_mm256_loadu_ps(out + 8 * j), v));
    }
}
/* EF-SignSGD's residual, a byte at a time with AVX2: t - (bit ? s : -s), one IEEE subtraction per lane. */
__attribute__((target("avx2"))) static int64_t sign_residual_avx2(const float* t, const uint8_t* packed, float s,
                                                                   float* out, int64_t n) {
    const __m256 neg = _mm256_set1_ps(-s), pos = _mm256_set1_ps(s);
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const int stream = n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(packed[i >> 3]), bit), bit);
        const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(t + i), _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(on)));
        if (stream) _mm256_stream_ps(out + i, v);
        else _mm256_storeu_ps(out + i, v);
    }
    if (stream) _mm_sfence();
    return i;
}
#endif
/* EF-SignSGD's residual in one pass: out = t - (bit ? s : -s) per element, bitwise torch.sub of
   the decoded signs (each decoded value is exactly +-s; one IEEE subtraction, t first). Whole
   bytes take their 8 decoded values from a 256-entry table as one vector. out may be t. */
AC_CLONES void ac_sign_residual(const float* t, const uint8_t* packed, float s, float* out, int64_t n) {
    const float tab[2] = {-s, s};
    int64_t i = 0;
#if defined(AC_AVX2)
    if (use_avx2()) i = sign_residual_avx2(t, packed, s, out, n);
#endif
    if (n - i >= 1 << 14) {
        float* bt = (float*)malloc(256 * 8 * sizeof(float));
        if (bt != NULL) {
            for (int byte = 0; byte < 256; ++byte)
                for (int k = 0; k < 8; ++k) bt[byte * 8 + k] = tab[(byte >> k) & 1];
            for (; i + 8 <= n; i += 8) {
                ac_v8f v, x;
                __builtin_memcpy(&v, bt + packed[i >> 3] * 8, sizeof v);
                __builtin_memcpy(&x, t + i, sizeof x);
                x = x - v;
                __builtin_memcpy(out + i, &x, sizeof x);
            }
            free(bt);
        }
    }
    for (; i < n; ++i) out[i] = t[i] - tab[(packed[i >> 3] >> (i & 7)) & 1];
}
#if defined(AC_AVX2)
/* ac_table_mean for 1- and 4-bit codes and a power-of-two world, buckets starting at multiples of 8
   (or one bucket): each group of 8 outputs is summed over the ranks in rank order and multiplied by
   1 / world in registers (the run loop's operations), written once; streamed (never read first: the
   mean goes to memory anyway) where the output is 32-byte aligned and has AC_STREAM_MIN elements. */
#define TABLE_STORE(p, v) do { if (stream) _mm256_stream_ps((p), (v)); else _mm256_storeu_ps((p), (v)); } while (0)
__attribute__((target("avx2"))) static void table_mean_pow2(const uint64_t* packed, const uint64_t* tables,
                                                               int world, int64_t n, int bits, int64_t size,
                                                               float inv, float* out, int stream) {
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t lo = 0; lo < n; lo += size) {
        const int64_t groups = ((lo + size < n ? lo + size : n) - lo) / 8, b = lo / size;
        if (world == 2) {  /* the common case with both ranks' tables in registers */
            const uint8_t *p0 = (const uint8_t*)(uintptr_t)packed[0], *p1 = (const uint8_t*)(uintptr_t)packed[1];
            const float *a = (const float*)(uintptr_t)tables[0] + (b << bits);
            const float *c = (const float*)(uintptr_t)tables[1] + (b << bits);
            if (bits == 1) {
                const __m256 a0 = _mm256_set1_ps(a[0]), a1 = _mm256_set1_ps(a[1]);
                const __m256 c0 = _mm256_set1_ps(c[0]), c1 = _mm256_set1_ps(c[1]);
                for (int64_t g = 0, j = lo >> 3; g < groups; ++g, ++j)
                    TABLE_STORE(out + lo + 8 * g, _mm256_mul_ps(_mm256_add_ps(decode1_avx2(p0[j], a0, a1),
                                                                              decode1_avx2(p1[j], c0, c1)), iv));
            } else {
                const __m256 alo = _mm256_loadu_ps(a), ahi = _mm256_loadu_ps(a + 8);
                const __m256 clo = _mm256_loadu_ps(c), chi = _mm256_loadu_ps(c + 8);
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t i = lo + 8 * g;
                    TABLE_STORE(out + i, _mm256_mul_ps(_mm256_add_ps(decode4_avx2(p0 + (i >> 1), alo, ahi),
                                                                     decode4_avx2(p1 + (i >> 1), clo, chi)), iv));
                }
            }
        }
        for (int64_t g = world == 2 ? groups : 0; g < groups; ++g) {
            const int64_t i = lo + 8 * g;
            __m256 acc = _mm256_setzero_ps();
            for (int r = 0; r < world; ++r) {
                const uint8_t* pk = (const uint8_t*)(uintptr_t)packed[r];
                const float* tab = (const float*)(uintptr_t)tables[r] + (b << bits);
                const __m256 v = bits == 1 ? decode1_avx2(pk[i >> 3], _mm256_set1_ps(tab[0]), _mm256_set1_ps(tab[1]))
                                           : decode4_avx2(pk + (i >> 1), _mm256_loadu_ps(tab), _mm256_loadu_ps(tab + 8));
                acc = r == 0 ? v : _mm256_add_ps(acc, v);
            }
            TABLE_STORE(out + i, _mm256_mul_ps(acc, iv));
        }
        for (int64_t i = lo + 8 * groups; i < (lo + size < n ? lo + size : n); ++i) {
            float a = 0.0f;
            for (int r = 0; r < world; ++r) {
                const uint8_t* pk = (const uint8_t*)(uintptr_t)packed[r];
                const float* tab = (const float*)(uintptr_t)tables[r] + (b << bits);
                const float v = tab[(pk[(i * bits) >> 3] >> ((i * bits) & 7)) & ((1u << bits) - 1u)];
                a = r == 0 ? v : a + v;
            }
            out[i] = a * inv;
        }
    }
    if (stream) _mm_sfence();
}
#undef TABLE_STORE
#endif
AC_CLONES void ac_table_mean(const uint64_t* packed, const uint64_t* tables, int world, int64_t n, int bits,
                   int64_t size, float* out) {
#if defined(AC_AVX2)
    if ((bits == 1 || bits == 4) && (world & (world - 1)) == 0 && (size % 8 == 0 || size >= n) && use_avx2()) {
        table_mean_pow2(packed, tables, world, n, bits, size, 1.0f / (float)world, out,
                          n >= AC_STREAM_MIN && ((uintptr_t)out & 31) == 0);
        return;
    }
#endif
    const unsigned mask = (1u << bits) - 1u;
    const int per = 8 / bits;
    const float w = (float)world;
    const int pow2 = (world & (world - 1)) == 0;
    const float inv = 1.0f / w;
    float* bt = size / per >= TABLE_BYTE_MIN ? (float*)malloc((size_t)world * 256 * 8 * sizeof(float)) : NULL;
#if defined(AC_AVX2)
    const int avx2 = use_avx2();
#endif
    for (int64_t lo0 = 0; lo0 < n; lo0 += size) {
        const int64_t hi0 = lo0 + size < n ? lo0 + size : n, b = lo0 / size;
        const int bytes = bt != NULL && (hi0 - lo0) / per >= TABLE_BYTE_MIN;
        if (bytes)
            for (int r = 0; r < world; ++r) {
                const float* tab = (const float*)(uintptr_t)tables[r] + (b << bits);
                float* tr = bt + (size_t)r * 256 * 8;
                for (int byte = 0; byte < 256; ++byte)
                    for (int k = 0; k < per; ++k) tr[byte * per + k] = tab[(byte >> (k * bits)) & mask];
            }
        for (int64_t lo = lo0; lo < hi0; lo += TABLE_RUN) {
            const int64_t hi = lo + TABLE_RUN < hi0 ? lo + TABLE_RUN : hi0;
            for (int r = 0; r < world; ++r) {
                const uint8_t* pk = (const uint8_t*)(uintptr_t)packed[r];
                const float* tab = (const float*)(uintptr_t)tables[r] + (b << bits);
                int64_t i = lo;
                for (; i < hi && i % per; ++i)  /* up to the first whole byte */
                    out[i] = r == 0 ? tab[(pk[(i * bits) >> 3] >> ((i * bits) & 7)) & mask]
                                    : out[i] + tab[(pk[(i * bits) >> 3] >> ((i * bits) & 7)) & mask];
                const int64_t whole = i + (hi - i) / per * per;
#if defined(AC_AVX2)
                if (bits == 1 && avx2) {
                    const int64_t nbytes = (whole - i) / 8;
                    table1_avx2(pk + (i >> 3), tab, out + i, nbytes, r == 0);
                    i += 8 * nbytes;
                }
#endif
                if (bytes) {
                    const float* tr = bt + (size_t)r * 256 * 8;
                    switch (bits) {
                    case 1: BYTE_TABLE(1, ac_v8f); break;
                    case 2: BYTE_TABLE(2, ac_v4f); break;
                    default: BYTE_TABLE(4, ac_v2f); break;
                    }
                } else {
#if defined(AC_AVX2)
                    if (bits == 4 && avx2) {
                        const int64_t groups = (whole - i) / 8;
                        table4_avx2(pk + ((i * 4) >> 3), tab, out + i, groups, r == 0);
                        i += 8 * groups;
                    }
#endif
                    switch (bits) {  /* constant widths: the per-byte loops unroll */
                    case 1: TABLE_BYTES(1); break;
                    case 2: TABLE_BYTES(2); break;
                    default: TABLE_BYTES(4); break;
                    }
                }
                for (; i < hi; ++i)
                    out[i] = r == 0 ? tab[(pk[(i * bits) >> 3] >> ((i * bits) & 7)) & mask]
                                    : out[i] + tab[(pk[(i * bits) >> 3] >> ((i * bits) & 7)) & mask];
            }
            if (pow2) for (int64_t i = lo; i < hi; ++i) out[i] = out[i] * inv;
            else for (int64_t i = lo; i < hi; ++i) out[i] = out[i] / w;
        }
    }
    free(bt);
}
/* ac_table_mean of m EF-SignSGD entries in one call, their payloads read in the gathered bytes at base:
   rank r's float32 scale s at scale_off[i * world + r] and its 1-bit signs at bits_off[...], decoded
   through the table (-s, +s) as the compressor's mean_into builds it (the same call, the same bits).
   pk, tb: world uint64 of scratch; tables: 2 * world floats of scratch. */
void ac_sign_mean_many(int64_t m, float* const* outs, const int64_t* ns, int world, const uint8_t* base,
                       const int64_t* scale_off, const int64_t* bits_off, uint64_t* pk, uint64_t* tb, float* tables) {
    for (int64_t i = 0; i < m; ++i) {
        for (int r = 0; r < world; ++r) {
            float s;
            __builtin_memcpy(&s, base + scale_off[i * world + r], sizeof s);
            tables[2 * r] = -s;
            tables[2 * r + 1] = s;
            pk[r] = (uint64_t)(uintptr_t)(base + bits_off[i * world + r]);
            tb[r] = (uint64_t)(uintptr_t)(tables + 2 * r);
        }
        ac_table_mean(pk, tb, world, ns[i], 1, ns[i], outs[i]);
    }
}
/* QSGD's mean_into for m outputs in one call, the payloads read where they lie in the gathered bytes:
   output i (ns[i] elements in buckets of sizes[i], bits[i]-bit codes, s[i] levels) takes, for every
   rank r, the float32 bucket norms at byte norm_off[i * world + r] and the packed codes at
   code_off[...]; each rank's table holds (norm / s) * (code - s) per bucket and code, float32 as
   torch's tensor / int and * levels form them, and ac_table_mean decodes and averages. tables:
   scratch of world * buckets << bits floats for the largest entry. */
void ac_qsgd_mean_many(int64_t m, float* const* outs, const int64_t* ns, const int64_t* sizes, const int32_t* bits,
                       const int32_t* s, int world, const uint8_t* base, const int64_t* norm_off,
                       const int64_t* code_off, uint64_t* pk, uint64_t* tb, float* tables) {
    for (int64_t i = 0; i < m; ++i) {
        const int64_t nb = (ns[i] + sizes[i] - 1) / sizes[i], nc = (int64_t)1 << bits[i];
        const float fs = (float)s[i];
        for (int r = 0; r < world; ++r) {
            float* t = tables + (int64_t)r * nb * nc;
            for (int64_t b = 0; b < nb; ++b) {
                float norm;
                __builtin_memcpy(&norm, base + norm_off[i * world + r] + 4 * b, sizeof norm);
                const float unit = norm / fs;
                for (int64_t c = 0; c < nc; ++c) t[b * nc + c] = unit * (float)(c - s[i]);
            }
            pk[r] = (uint64_t)(uintptr_t)(base + code_off[i * world + r]);
            tb[r] = (uint64_t)(uintptr_t)t;
        }
        ac_table_mean(pk, tb, world, ns[i], bits[i], sizes[i], outs[i]);
    }
}
/* torch's CPU generator (the Mersenne Twister MT19937 of CPUGeneratorImpl) worked on the bytes of
   its get_state(): int64 seed @0, int32 left @8, int32 seeded @12, uint64 next @16, uint64
   state[624] @24 (32-bit words). A float32 uniform_ on [0, 1) takes one tempered 32-bit output per
   element, in order, and keeps (r & 0xFFFFFF) * 2^-24, exact in float32. */
#define MT_N 624
#define MT_M 397
#define MT_TW(u, v) (((((u) & 0x80000000u) | ((v) & 0x7fffffffu)) >> 1) ^ (((v) & 1u) ? 0x9908b0dfu : 0u))
static inline void mt_twist(uint32_t* s) {
    int k;
    for (k = 0; k < MT_N - MT_M; ++k) s[k] = s[k + MT_M] ^ MT_TW(s[k], s[k + 1]);
    for (; k < MT_N - 1; ++k) s[k] = s[k + MT_M - MT_N] ^ MT_TW(s[k], s[k + 1]);
    s[MT_N - 1] = s[MT_M - 1] ^ MT_TW(s[MT_N - 1], s[0]);
}
static int mt_load(const uint8_t* st, uint32_t* s, int32_t* left, uint64_t* next) {
    __builtin_memcpy(left, st + 8, 4);
    __builtin_memcpy(next, st + 16, 8);
    if (*left < 1 || *left > MT_N || *next > MT_N || (int64_t)*next + *left - 1 > MT_N) return -1;
    for (int k = 0; k < MT_N; ++k) { uint64_t w; __builtin_memcpy(&w, st + 24 + 8 * k, 8); s[k] = (uint32_t)w; }
    return 0;
}
static void mt_store(uint8_t* st, const uint32_t* s, int32_t left, uint64_t next) {
    __builtin_memcpy(st + 8, &left, 4);
    __builtin_memcpy(st + 16, &next, 8);
    for (int k = 0; k < MT_N; ++k) { uint64_t w = s[k]; __builtin_memcpy(st + 24 + 8 * k, &w, 8); }
}
/* MT19937's tempering of a state word: the generator's 32-bit output */
static inline uint32_t mt_temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}
/* the next n uniforms of the stream into out (out may be NULL: the numbers are drawn and dropped) */
AC_CLONES static void mt_fill(uint32_t* s, int32_t* left, uint64_t* next, float* out, int64_t n) {
    int64_t i = 0;
    while (i < n) {
        if (*left == 1) { mt_twist(s); *left = MT_N + 1; *next = 0; }
        int64_t run = *left - 1 < n - i ? *left - 1 : n - i;
        if (out) {
            const uint32_t* src = s + *next;
            for (int64_t j = 0; j < run; ++j) {
                out[i + j] = (float)(mt_temper(src[j]) & 0xFFFFFFu) * (1.0f / 16777216.0f);
            }
        }
        i += run; *next += run; *left -= (int32_t)run;
    }
}
AC_CLONES int ac_mt_uniform(uint8_t* st, float* out, int64_t n) {
    int32_t left; uint64_t next; uint32_t s[MT_N];
    if (mt_load(st, s, &left, &next)) return -1;
    mt_fill(s, &left, &next, out, n);
    mt_store(st, s, left, next);
    return 0;
}
/* DGC's threshold sample: torch.randint(n, (m,), generator) and a gather of a at those positions in one
   call. torch's CPU randint with a range under 2^32 takes one tempered 32-bit output per element, in
   order, and keeps it modulo the range (uniform_int_from_to_distribution); here the positions of a
   chunk are drawn first and the gather's loads prefetched SAMPLE_TAKE_AHEAD ahead (a's lines are far
   apart and out of cache: the momentum pass streamed it). The values in draw order; no position
   tensor written. -1 (nothing drawn) on a range outside [1, 2^32) or a state it cannot read. */
#define SAMPLE_TAKE_CHUNK 512
#define SAMPLE_TAKE_AHEAD 48
static int mt_sample_take(uint8_t* st, const float* a, int64_t n, int64_t m, float* out) {
    int32_t left; uint64_t next; uint32_t s[MT_N];
    if (n < 1 || n > (int64_t)0xFFFFFFFFLL || mt_load(st, s, &left, &next)) return -1;
    uint32_t pos[SAMPLE_TAKE_CHUNK];
    const uint64_t inv = ~(uint64_t)0 / (uint64_t)n + 1;  /* y % n by two multiplies (Lemire's fastmod, exact for
                                                              32-bit y and n): a 64-bit division a draw cost more
                                                              than drawing */
    for (int64_t i = 0; i < m; i += SAMPLE_TAKE_CHUNK) {
        const int c = m - i < SAMPLE_TAKE_CHUNK ? (int)(m - i) : SAMPLE_TAKE_CHUNK;
        for (int k = 0; k < c;) {
            if (left == 1) { mt_twist(s); left = MT_N + 1; next = 0; }
            const int run = left - 1 < c - k ? left - 1 : c - k;
            const uint32_t* src = s + next;
            for (int j = 0; j < run; ++j)
                pos[k + j] = (uint32_t)(((unsigned __int128)(inv * mt_temper(src[j])) * (uint64_t)n) >> 64);
            k += run;
            next += (uint64_t)run;
            left -= run;
        }
        for (int k = 0; k < c && k < SAMPLE_TAKE_AHEAD; ++k) __builtin_prefetch(a + pos[k]);
        for (int k = 0; k < c; ++k) {
            if (k + SAMPLE_TAKE_AHEAD < c) __builtin_prefetch(a + pos[k + SAMPLE_TAKE_AHEAD]);
            out[i + k] = a[pos[k]];
        }
    }
    mt_store(st, s, left, next);
    return 0;
}
int ac_mt_sample_take(uint8_t* st, const float* a, int64_t n, int64_t m, float* out) {
    return mt_sample_take(st, a, n, m, out);
}
/* DGC's choice (adacomp.compressors.dgc.DGCCompressor.choose) in one call, the same answers as its
   chain of calls: the threshold is the ks-th largest |x| of m values of a drawn at torch.randint's
   positions from the generator state st into `sample` (st advanced; st NULL with m < n: the sample
   is there already; m == n: a itself is the sample); the
   chosen are the positions of |a| >= thr (thr as a float32, as ctypes passes it), from the momentum
   pass's candidates (cidx, cvals signed, nc of them, kept at floor) where thr >= floor, else from a
   pass over a; while fewer than lower * k passed (at most iters times) thr *= lower (in double, as
   Python multiplies). The positions and signed values into sel; returns how many (more than
   upper * k: the caller picks the k largest |x| among them, ac_pick_largest). -1 where the Python
   path must answer (a NaN, none passed), -2 - c where c passed a threshold, more than cap: the
   caller keeps st unless this succeeds. keys: m of scratch. */
int64_t ac_dgc_choose(const float* a, int64_t n, uint8_t* st, int64_t m, int64_t ks, const float* cvals,
                      const int64_t* cidx, int64_t nc, double floor, int64_t k, double lower, int64_t iters,
                      float* sample, uint32_t* keys, int64_t* sel_idx, float* sel_vals, int64_t cap) {
    const float* smp = a;
    if (m < n) {  /* st NULL: the sample was drawn into `sample` by a call that ran out of room */
        if (st != NULL && mt_sample_take(st, a, n, m, sample) != 0) return -1;
        smp = sample;
    }
    uint32_t kth;
    int64_t ties;
    if (ks < 1 || ks > m || radix_kth((const uint32_t*)smp, 1, 0x7fffffffu, m, ks, keys, &kth, &ties) != 0)
        return -1;  /* a NaN in the sample */
    float thr_f;
    __builtin_memcpy(&thr_f, &kth, sizeof thr_f);
    double thr = (double)thr_f;
    int64_t c = 0;
    for (int64_t it = 0;; ++it) {
        const float t = (float)thr;
        if (cvals != NULL && thr >= floor) {
            c = ac_pick_pairs(cvals, cidx, nc, t, 0, sel_idx, sel_vals, cap);
        } else {
            c = ac_select_abs_ge_signed(a, n, t, sel_idx, sel_vals, cap);
        }
        if (c > cap) return -2 - c;  /* the caller calls again with room for them */
        if (it >= iters || (double)c >= lower * (double)k) break;
        thr *= lower;
    }
    return c > 0 ? c : -1;  /* none passed: the Python path's argmax */
}
/* SIDCo-E's choice (adacomp.compressors.sidco.SIDCoCompressor.choose, exponential fits on the C
   passes) in one call, the same answers as its chain of calls: stages - 1 later fits, each
   ac_tail_sum_keep at thr (as a float32) with the floor thr + margin[s] (in double, as Python adds;
   levels guessed from expect[s]) over the kept set where thr >= its floor (the error-feedback pass's
   candidates cv / ci, nc of them kept at cfloor, nc < 0: none; then each stage's own set, int32
   positions, written into k0 / k1 in turn, kcap0 / kcap1 of room), else over a; its mean is the float32 quotient of the sum
   and the count (torch's mean from its sum) and thr += -mean * lr (lr = log of the per-stage
   ratio). Then the positions and signed values of |x| > thr from the kept set where it covers thr,
   else from a pass over a, into oi / ov. info: [0] the final thr, [1] / [2] / [3] the room a retry
   needs in k0, k1 and oi / ov, [4] how many passes read a, then per later stage its mean, count and
   kept count. Returns how many
   were chosen; -1 where the Python path must answer (fewer than 8 passed a later threshold, a
   threshold not finite), -2 where a set outgrew its room (info[1-3] say how much). */
int64_t ac_sidco_choose(const float* a, int64_t n, const float* cv, const int64_t* ci, int64_t nc, double cfloor,
                        double thr, double lr, int64_t later, const double* margin, const int64_t* expect,
                        int32_t* k0i, float* k0v, int64_t kcap0, int32_t* k1i, float* k1v, int64_t kcap1,
                        int64_t* oi, float* ov, int64_t ocap, double* info) {
    const float* kv = nc >= 0 ? cv : NULL;
    const int32_t* k32 = NULL;
    const int64_t* k64 = ci;
    int64_t nk = nc;
    double fl = cfloor;
    for (int q = 1; q < 5; ++q) info[q] = 0.0;
    for (int64_t s = 0; s < later; ++s) {
        const double f = thr + margin[s];
        if (!(__builtin_isfinite(thr) && __builtin_isfinite(f) && f >= thr)) return -1;
        const int cov = kv != NULL && thr >= fl;
        const float* src = cov ? kv : a;
        const int32_t* p32 = cov ? k32 : NULL;
        const int64_t* p64 = cov ? k64 : NULL;
        const int64_t ns = cov ? nk : n;
        info[4] += cov ? 0.0 : 1.0;
        int32_t* wi = (s & 1) ? k1i : k0i;
        float* wv = (s & 1) ? k1v : k0v;
        const int64_t kcap = (s & 1) ? kcap1 : kcap0;
        int64_t cnt = 0;
        float sum = 0.0f;
        int lp = ac_tail_levels(expect[s]), lp_out = 0;
        int64_t kept = ac_tail_sum_keep(src, p32, p64, ns, (float)thr, lp, (float)f, wi, wv, kcap, &cnt, &sum, &lp_out);
        if (lp_out != lp) {  /* the count's own levels, known now: the sum again (as the chain calls again) */
            lp = lp_out;
            kept = ac_tail_sum_keep(src, p32, p64, ns, (float)thr, lp, (float)f, wi, wv, kcap, &cnt, &sum, &lp_out);
        }
        if (cnt < 8) return -1;
        if (kept > kcap) {
            info[1 + (s & 1)] = (double)kept;
            return -2;
        }
        const float mean = sum / (float)cnt;
        info[5 + 3 * s] = (double)mean;
        info[6 + 3 * s] = (double)cnt;
        info[7 + 3 * s] = (double)kept;
        thr = thr + -(double)mean * lr;
        kv = wv;
        k32 = wi;
        k64 = NULL;
        nk = kept;
        fl = f;
    }
    if (!__builtin_isfinite(thr)) return -1;
    const float t = (float)thr;
    int64_t c;
    if (kv != NULL && thr >= fl) {
        c = k32 != NULL ? ac_pick_pairs32(kv, k32, nk, t, 1, oi, ov, ocap) : ac_pick_pairs(kv, k64, nk, t, 1, oi, ov, ocap);
    } else {
        c = ac_select_abs_gt_signed(a, n, t, oi, ov, ocap);
        info[4] += 1.0;
    }
    if (c > ocap) {
        info[3] = (double)c;
        return -2;
    }
    info[0] = thr;
    return c;
}
/* The l2 norm of one bucket in torch's order for a float32 norm over a contiguous last dimension
   whose length is a multiple of the vector width: `lanes` accumulators (element j adds its square,
   rounded, to lane j % lanes), then lane 0 + lane 1 + ... in turn, then the square root. The zero
   padding of a partial bucket adds +0 to its lanes, which changes nothing, so m may be short. */
static inline __attribute__((always_inline)) float bucket_norm(const float* x, int64_t m, const int lanes) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + lanes <= m; d += lanes)
        for (int l = 0; l < lanes; ++l) acc[l] += x[d + l] * x[d + l];
    for (int l = 0; d + l < m; ++l) acc[l] += x[d + l] * x[d + l];
    float b = acc[0];
    for (int l = 1; l < lanes; ++l) b += acc[l];
    return __builtin_sqrtf(b);
}
/* norms of the nb buckets of `size` elements starting at bucket b0 of x (n real elements) */
static void bucket_norms(const float* x, int64_t n, int64_t size, int lanes, int64_t b0, int64_t nb, float* norms) {
    for (int64_t b = b0; b < b0 + nb; ++b) {
        const int64_t lo = b * size, m = n - lo < size ? n - lo : size;
        norms[b] = lanes == 16 ? bucket_norm(x + lo, m, 16) : bucket_norm(x + lo, m, 8);
    }
}
int ac_bucket_norms(const float* x, int64_t n, int64_t size, int lanes, float* norms) {
    if (size < 1 || size % lanes || (lanes != 8 && lanes != 16)) return -1;
    bucket_norms(x, n, size, lanes, 0, (n + size - 1) / size, norms);
    return 0;
}
/* A counter-based uniform stream (QSGD's `rng: counter`): element i of a call keyed (k0, k1) gets
   h = mix(((uint32)i + k0) ^ (k1 + (uint32)(i >> 32) * 0x9E3779B9)), mix = the "lowbias32" integer
   hash (xor-shift 16, * 0x7feb352d, xor-shift 15, * 0x846ca68b, xor-shift 16, a bijection), and
   keeps (h >> 8) * 2^-24, exact in float32. A call's key is pseudo-random, so each element's input,
   hence its number, is uniform over the calls. No state to load or advance: each number is a
   function of its position, so the loop vectorises (8 lanes with AVX2, two multiplies a vector:
   one round, since a second doubles the cost on multiply-bound cores) and splits across threads;
   _counter_rng.py's torch twin gives the same bits. */
static inline uint32_t ctr_mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
/* in runs of constant hi32(i), so the loop body is 32-bit lanes only (vectorised) */
AC_CLONES static void ctr_fill(uint32_t k0, uint32_t k1, int64_t start, float* out, int64_t n) {
    int64_t j = 0;
    while (j < n) {
        const uint64_t i0 = (uint64_t)(start + j);
        const uint64_t room = ((i0 >> 32) + 1) * 0x100000000ull - i0;  /* positions before hi32 changes */
        const int32_t run = (int32_t)((uint64_t)(n - j) < room ? (uint64_t)(n - j) : room) > 0x40000000
                            ? 0x40000000 : (int32_t)((uint64_t)(n - j) < room ? (uint64_t)(n - j) : room);
        const uint32_t kh = k1 + (uint32_t)(i0 >> 32) * 0x9E3779B9u, base = (uint32_t)i0 + k0;
        float* o = out + j;
        for (int32_t t = 0; t < run; ++t) {
            const uint32_t h = ctr_mix((base + (uint32_t)t) ^ kh);
            o[t] = (float)(int32_t)(h >> 8) * (1.0f / 16777216.0f);
        }
        j += run;
    }
}
int ac_ctr_uniform(uint32_t k0, uint32_t k1, int64_t start, float* out, int64_t n) {
    if (start < 0 || n < 0) return -1;
    ctr_fill(k0, k1, start, out, n);
    return 0;
}
/* QSGD's whole compress, in tiles that stay in L1: each tile's uniforms from the generator state st
   (in stream order, the padding of the last bucket drawn too), its codes (ac_qsgd_codes) and their
   packing (ac_pack) into out. With norms (lanes 8 or 16), the bucket norms too, each just before
   its bucket's first tile (so the codes read the gradient from cache), and safe[b] = norms[b] > 0 ?
   norms[b] : 1; without, safe holds them already. Bitwise the block loop of qsgd.py; -1 (st
   untouched) on a NaN code or an unreadable state. With key (k0, k1) instead of st (NULL), the
   uniforms are the counter stream's (ctr_fill, element i's number at position i). */
#define QSGD_TILE 2048
int ac_qsgd_compress(const float* x, int64_t n, int64_t padded, float* safe, int64_t size, float s, int bits,
                     uint8_t* st, const uint32_t* key, uint8_t* out, float* norms, int lanes) {
    int32_t left = 0; uint64_t next = 0; uint32_t mt[MT_N];
    float rnd[QSGD_TILE];
    uint8_t codes[QSGD_TILE];
    int64_t normed = 0;  /* buckets whose norms are done */
    if (norms && (size % lanes || (lanes != 8 && lanes != 16))) return -1;
    if (!key && (!st || mt_load(st, mt, &left, &next))) return -1;
    for (int64_t lo = 0; lo < n; lo += QSGD_TILE) {
        const int64_t m = n - lo < QSGD_TILE ? n - lo : QSGD_TILE;
        if (norms) {
            const int64_t upto = (lo + m - 1) / size + 1;
            bucket_norms(x, n, size, lanes, normed, upto - normed, norms);
            for (; normed < upto; ++normed) safe[normed] = norms[normed] > 0.0f ? norms[normed] : 1.0f;
        }
        if (key) ctr_fill(key[0], key[1], lo, rnd, m);
        else mt_fill(mt, &left, &next, rnd, m);
        if (ac_qsgd_codes(x + lo, m, rnd, safe, lo, size, s, codes)) return -1;
        if (bits == 8) __builtin_memcpy(out + lo, codes, (size_t)m);
        else ac_pack(codes, m, bits, out + lo * bits / 8);
    }
    if (key) return 0;
    mt_fill(mt, &left, &next, NULL, padded - n);
    mt_store(st, mt, left, next);
    return 0;
}
"""
_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off", "-std=c99"]

_lib: ctypes.CDLL | None = None
_tried = False
_error = ""


def _cache_dir() -> Path:
    return Path(os.environ.get("ADACOMP_CACHE", Path.home() / ".cache" / "adacomp")) / "native"


def _build(source: str | None = None) -> ctypes.CDLL:
    """The library of this module's C, or of ``source`` (another version's ``_SOURCE``, which must
    define every function :func:`_load` declares), built once per text and compiler."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    text = _SOURCE if source is None else source
    key = hashlib.sha256((text + " ".join(_FLAGS) + cc).encode()).hexdigest()[:16]
    try:
        return _load(_compiled(cc, _cache_dir() / f"adacomp_native_{key}.so", text))
    except OSError:  # a read-only home: build in the temporary directory instead
        return _load(_compiled(cc, Path(tempfile.gettempdir()) / f"adacomp-native-{os.getuid()}"
                               / f"adacomp_native_{key}.so", text))


def _compiled(cc: str, out: Path, source: str) -> Path:
    """``out`` built from the C text ``source`` unless it exists."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / "native.c"
            src.write_text(source)
            lib = Path(tmp) / out.name
            proc = subprocess.run([cc, *_FLAGS, "-o", str(lib), str(src)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
            os.replace(lib, out)  # atomic: ranks building at once each rename a complete file
    return out


def _load(out: Path) -> ctypes.CDLL:
    lib_ = ctypes.CDLL(str(out))
    for mode in [*MODES, *(f"abs_{m}" for m in MODES)]:
        f = getattr(lib_, f"ac_select_{mode}")
        f.restype = ctypes.c_int64
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_int64]
        g = getattr(lib_, f"ac_count_{mode}")
        g.restype = ctypes.c_int64
        g.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for fname, args in (("ac_pack", [vp, i64, ctypes.c_int, vp]), ("ac_unpack", [vp, i64, ctypes.c_int, vp]),
                        ("ac_pack_nonneg", [vp, i64, vp]), ("ac_decode", [vp, i64, ctypes.c_int, vp, vp])):
        fn = getattr(lib_, fname)
        fn.restype = None
        fn.argtypes = args
    for mode in ("abs_ge", "abs_gt", "abs_not_lt"):
        fs = getattr(lib_, f"ac_select_{mode}_signed")
        fs.restype = ctypes.c_int64
        fs.argtypes = [vp, i64, ctypes.c_float, vp, vp, i64]
    for mode in ("ge", "not_lt", "abs_ge", "abs_not_lt"):
        fr = getattr(lib_, f"ac_select_rows_{mode}")
        fr.restype = ctypes.c_int64
        fr.argtypes = [vp, i64, i64, vp, vp, vp, i64]
    for fname in ("ac_mm_seq", "ac_mtm_seq"):
        fm = getattr(lib_, fname)
        fm.restype = None
        fm.argtypes = [vp, i64, i64, vp, i64, vp, i64]
    lib_.ac_row_candidates.restype = ctypes.c_int64
    lib_.ac_row_candidates.argtypes = [vp, i64, i64, i64, i64, ctypes.c_float, vp, vp, vp, vp, i64, vp, vp,
                                       ctypes.c_int]
    lib_.ac_momentum_accumulate.restype = None
    lib_.ac_momentum_accumulate.argtypes = [vp, vp, vp, vp, vp, i64, ctypes.c_float]
    lib_.ac_momentum_select_abs_ge.restype = ctypes.c_int64
    lib_.ac_momentum_select_abs_ge.argtypes = [vp, vp, vp, vp, vp, i64, ctypes.c_float, ctypes.c_float, vp, vp, i64,
                                               vp, i64]
    lib_.ac_ascending_within.restype = ctypes.c_int
    lib_.ac_ascending_within.argtypes = [vp, i64, i64]
    lib_.ac_sorted_member.restype = None
    lib_.ac_sorted_member.argtypes = [vp, i64, vp, i64, vp]
    lib_.ac_merge_sum.restype = ctypes.c_int64
    lib_.ac_merge_sum.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp, vp]
    lib_.ac_take_grouped.restype = ctypes.c_int
    lib_.ac_take_grouped.argtypes = [vp, i64, vp, i64, ctypes.c_int, vp, vp, vp]
    lib_.ac_select_abs_gt_signed32.restype = ctypes.c_int64
    lib_.ac_select_abs_gt_signed32.argtypes = [vp, i64, ctypes.c_float, vp, vp, i64]
    lib_.ac_pick_pairs32.restype = ctypes.c_int64
    lib_.ac_pick_pairs32.argtypes = [vp, vp, i64, ctypes.c_float, ctypes.c_int, vp, vp, i64]
    lib_.ac_pick_pairs.restype = ctypes.c_int64
    lib_.ac_pick_pairs.argtypes = [vp, vp, i64, ctypes.c_float, ctypes.c_int, vp, vp, i64]
    lib_.ac_qsgd_codes.restype = ctypes.c_int
    lib_.ac_qsgd_codes.argtypes = [vp, i64, vp, vp, i64, i64, ctypes.c_float, vp]
    lib_.ac_table_mean.restype = None
    lib_.ac_table_mean.argtypes = [vp, vp, ctypes.c_int, i64, ctypes.c_int, i64, vp]
    lib_.ac_mt_sample_take.restype = ctypes.c_int
    lib_.ac_dgc_choose.restype = i64
    lib_.ac_dgc_choose.argtypes = [vp, i64, vp, i64, i64, vp, vp, i64, ctypes.c_double, i64, ctypes.c_double, i64,
                                   vp, vp, vp, vp, i64]
    lib_.ac_mt_sample_take.argtypes = [vp, vp, i64, i64, vp]
    lib_.ac_sidco_choose.restype = i64
    lib_.ac_sidco_choose.argtypes = [vp, i64, vp, vp, i64, ctypes.c_double, ctypes.c_double, ctypes.c_double, i64,
                                     vp, vp, vp, vp, i64, vp, vp, i64, vp, vp, i64, vp]
    lib_.ac_mt_uniform.restype = ctypes.c_int
    lib_.ac_mt_uniform.argtypes = [vp, vp, i64]
    lib_.ac_qsgd_compress.restype = ctypes.c_int
    lib_.ac_ctr_uniform.restype = ctypes.c_int
    lib_.ac_ctr_uniform.argtypes = [ctypes.c_uint32, ctypes.c_uint32, i64, vp, i64]
    lib_.ac_qsgd_compress.argtypes = [vp, i64, i64, vp, i64, ctypes.c_float, ctypes.c_int, vp, vp, vp, vp,
                                      ctypes.c_int]
    lib_.ac_bucket_norms.restype = ctypes.c_int
    lib_.ac_bucket_norms.argtypes = [vp, i64, i64, ctypes.c_int, vp]
    lib_.ac_add_select_abs_not_lt.restype = ctypes.c_int64
    lib_.ac_abs_stats.restype = ctypes.c_int
    lib_.ac_cascade_sum.restype = ctypes.c_float
    lib_.ac_cascade_sum.argtypes = [vp, i64, ctypes.c_int]
    lib_.ac_cascade_sum_shifted.restype = ctypes.c_float
    lib_.ac_cascade_sum_shifted.argtypes = [vp, i64, ctypes.c_float, ctypes.c_int]
    lib_.ac_tail_sum_keep.restype = ctypes.c_int64
    lib_.ac_tail_sum_keep.argtypes = [vp, vp, vp, i64, ctypes.c_float, ctypes.c_int, ctypes.c_float, vp, vp, i64, vp,
                                      vp, vp]
    lib_.ac_abs_sum_pack.restype = None
    lib_.ac_add_cascade.restype = None
    lib_.ac_add_cascade.argtypes = [vp, vp, vp, i64, ctypes.c_int, vp, vp]
    lib_.ac_add_owed_cascade.restype = None
    lib_.ac_add_owed_cascade.argtypes = [vp, vp, vp, ctypes.c_float, vp, i64, ctypes.c_int, vp, vp]
    lib_.ac_abs_sum_pack.argtypes = [vp, i64, vp, vp]
    lib_.ac_add_moments_select.restype = ctypes.c_int64
    lib_.ac_add_moments_select.argtypes = [vp, vp, vp, i64, ctypes.c_float, vp, vp, i64, vp, vp]
    lib_.ac_sumsq_select_abs_gt.restype = ctypes.c_int64
    lib_.ac_sumsq_select_abs_gt.argtypes = [vp, i64, ctypes.c_double, ctypes.c_float, vp, vp, i64, vp, ctypes.c_int, vp]
    lib_.ac_abs_stats.argtypes = [vp, vp, i64, vp, vp]
    lib_.ac_add_abs_stats_select.restype = ctypes.c_int64
    lib_.ac_add_abs_stats_select.argtypes = [vp, vp, vp, i64, vp, vp, ctypes.c_float, ctypes.c_int, vp, vp, i64,
                                             vp, i64]
    lib_.ac_add_select_abs_not_lt.argtypes = [vp, vp, vp, i64, ctypes.c_float, vp, vp, i64, vp, i64]
    lib_.ac_add_count_select_segments.restype = ctypes.c_int64
    lib_.ac_add_count_select_segments.argtypes = [vp, vp, i64, vp, vp, ctypes.c_float, ctypes.c_float, vp, vp, i64,
                                                  vp, vp]
    lib_.ac_add_select_segments.restype = ctypes.c_int64
    lib_.ac_add_select_segments.argtypes = [vp, vp, i64, vp, vp, ctypes.c_float, vp, vp, i64]
    lib_.ac_sample_lines_segments.restype = None
    lib_.ac_sample_lines_segments.argtypes = [vp, vp, i64, vp, i64, i64, vp]
    lib_.ac_chunk_topk.restype = ctypes.c_int
    lib_.ac_pick_largest.restype = ctypes.c_int
    lib_.ac_pick_largest.argtypes = [vp, vp, i64, i64, vp, vp, vp, vp]
    lib_.ac_pick_largest_filtered.restype = ctypes.c_int
    lib_.ac_pick_largest_filtered.argtypes = [vp, i64, i64, vp, vp, vp, i64, vp, vp]
    lib_.ac_sparse_mean.restype = ctypes.c_int
    lib_.ac_outer_fma_sub.restype = None
    lib_.ac_outer_fma_sub.argtypes = [vp, vp, vp, vp, i64, i64, i64, vp]
    lib_.ac_owed_mm.restype = ctypes.c_int
    lib_.ac_owed_mm.argtypes = [vp, vp, i64, vp, vp, i64, i64, vp, vp, i64, vp, i64]
    lib_.ac_row_kth.restype = None
    lib_.ac_row_order_stats.restype = ctypes.c_int
    lib_.ac_row_order_stats.argtypes = [vp, vp, i64, i64, i64, vp, vp, vp, vp]
    lib_.ac_row_chosen.restype = ctypes.c_int64
    lib_.ac_row_chosen.argtypes = [vp, vp, vp, i64, i64, vp, vp, vp]
    lib_.ac_row_kth.argtypes = [vp, i64, i64, i64, vp, vp]
    lib_.ac_row_finish.restype = ctypes.c_int64
    lib_.ac_row_finish.argtypes = [vp, vp, i64, i64, i64, i64, i64, ctypes.c_int, vp, vp, vp, vp, vp, vp, vp, vp,
                                   vp, vp, vp, vp, vp, vp]
    lib_.ac_add.restype = None
    lib_.ac_add.argtypes = [vp, vp, vp, i64]
    lib_.ac_sub.restype = None
    lib_.ac_sub.argtypes = [vp, vp, vp, i64]
    lib_.ac_sparse_mean.argtypes = [vp, i64, ctypes.c_int, vp, vp, vp, vp, ctypes.c_float]
    lib_.ac_sparse_mean_many.restype = None
    lib_.ac_sparse_mean_many.argtypes = [i64, vp, vp, ctypes.c_int, vp, vp, vp, vp, vp, vp, vp, ctypes.c_float, vp]
    lib_.ac_qsgd_mean_many.restype = None
    lib_.ac_qsgd_mean_many.argtypes = [i64, vp, vp, vp, vp, vp, ctypes.c_int, vp, vp, vp, vp, vp, vp]
    lib_.ac_sign_mean_many.restype = None
    lib_.ac_sign_mean_many.argtypes = [i64, vp, vp, ctypes.c_int, vp, vp, vp, vp, vp, vp]
    lib_.ac_copy_many.restype = None
    lib_.ac_copy_many.argtypes = [vp, i64, i64, vp, vp, vp]
    lib_.ac_zero_at.restype = ctypes.c_int
    lib_.ac_outer_fma.restype = None
    lib_.ac_outer_fma.argtypes = [vp, vp, i64, i64, i64, vp]
    lib_.ac_sparse_mean_add_select.restype = ctypes.c_int64
    lib_.ac_sparse_mean_add_select.argtypes = [vp, vp, i64, ctypes.c_int, vp, vp, vp, vp, ctypes.c_float, ctypes.c_float,
                                               vp, vp, i64]
    lib_.ac_sparse_sample_lines.restype = ctypes.c_int
    lib_.ac_sparse_sample_lines.argtypes = [vp, i64, ctypes.c_int, vp, vp, vp, vp, ctypes.c_float, i64, i64, vp]
    lib_.ac_sample_lines.restype = None
    lib_.ac_sample_lines.argtypes = [vp, vp, i64, i64, vp]
    lib_.ac_sample_lines_zeroed.restype = None
    lib_.ac_sample_lines_zeroed.argtypes = [vp, vp, i64, i64, vp, vp, i64]
    lib_.ac_first_distinct.restype = ctypes.c_int64
    lib_.ac_first_distinct.argtypes = [vp, i64, i64, i64, vp, vp]
    lib_.ac_sign_residual.restype = None
    lib_.ac_sign_residual.argtypes = [vp, vp, ctypes.c_float, vp, i64]
    for fname in ("ac_to_bf16", "ac_from_bf16"):
        fc = getattr(lib_, fname)
        fc.restype = None
        fc.argtypes = [vp, vp, i64]
    lib_.ac_zero_at.argtypes = [vp, i64, vp, i64]
    lib_.ac_take.restype = ctypes.c_int
    lib_.ac_take.argtypes = [vp, i64, vp, i64, vp]
    lib_.ac_chunk_topk.argtypes = [vp, i64, i64, i64, vp, vp, vp, vp, vp, vp, vp, i64, vp]
    lib_.ac_chunk_decode.restype = ctypes.c_int
    lib_.ac_chunk_quantize.restype = ctypes.c_int
    lib_.ac_chunk_quantize.argtypes = [vp, i64, i64, ctypes.c_int, vp, vp]
    lib_.ac_bisect_band.restype = i64
    lib_.ac_bisect_band.argtypes = [vp, i64, ctypes.c_int, i64, ctypes.c_double, ctypes.c_double, i64, vp, vp, vp]
    lib_.ac_gauss_band.restype = i64
    lib_.ac_gauss_band.argtypes = [vp, i64, ctypes.c_int, vp, i64, ctypes.c_int, ctypes.c_double, ctypes.c_int, vp, vp,
                                   ctypes.c_double, ctypes.c_double, i64]
    lib_.ac_gauss_kept.restype = i64
    lib_.ac_gauss_kept.argtypes = [vp, i64, vp, vp, i64, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                                   ctypes.c_double, ctypes.c_double, ctypes.c_double, i64, i64, vp, vp, vp, vp, vp, vp]
    lib_.ac_gauss_whole.restype = i64
    lib_.ac_gauss_whole.argtypes = [vp, i64, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double, i64,
                                    i64, vp, vp, vp, vp, vp, vp]
    lib_.ac_chunk_encode.restype = ctypes.c_int
    lib_.ac_chunk_encode.argtypes = [vp, vp, i64, i64, ctypes.c_int, i64, vp, vp, vp, vp]
    lib_.ac_chunk_decode.argtypes = [vp, vp, ctypes.c_int, vp, vp, i64, i64, i64, i64, vp, vp]
    lib_.ac_chunk_mean.restype = ctypes.c_int
    lib_.ac_chunk_mean.argtypes = [vp, i64, ctypes.c_int, vp, vp, vp, ctypes.c_int, vp, i64, i64, i64, i64,
                                   ctypes.c_float, i64, vp, vp, vp, vp, vp, vp]
    lib_.ac_chunk_mean_many.restype = None
    lib_.ac_chunk_mean_many.argtypes = [i64, vp, vp, ctypes.c_int, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                        ctypes.c_float, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp]
    lib_.ac_sub_at.restype = ctypes.c_int
    lib_.ac_sub_at.argtypes = [vp, vp, i64, vp, vp, i64]
    h = lib_.ac_rth_largest_strided
    h.restype = ctypes.c_int
    h.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_int]
    return lib_


_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
"""os.environ's own bytes mapping (CPython, POSIX): the switch is read on every call, so that setting
it takes effect at once, and ``os.environ.get`` (key encoding and decoding) cost ~1 ms per step on a
150-tensor model at ~1000 calls."""


def _switched_off() -> bool:
    if isinstance(_ENV_BYTES, dict):
        return _ENV_BYTES.get(b"ADACOMP_NATIVE") == b"0"
    return os.environ.get("ADACOMP_NATIVE", "1") == "0"


_ENV_DICT = _ENV_BYTES if isinstance(_ENV_BYTES, dict) else None


def library() -> ctypes.CDLL | None:
    """The built library, or None (no compiler, a failed build, or ``ADACOMP_NATIVE=0``). (The
    switch is read inline: this runs ~25 times a compressed tensor, cost_notes item 85.)"""
    global _lib, _tried, _error
    if (_ENV_DICT.get(b"ADACOMP_NATIVE") == b"0") if _ENV_DICT is not None else _switched_off():
        return None
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except (OSError, RuntimeError) as exc:
            _error = str(exc)
            _lib = None
    return _lib


def why_unavailable() -> str:
    """Why :func:`library` returned None ('' when it did not)."""
    if _switched_off():
        return "ADACOMP_NATIVE=0"
    library()
    return _error


def usable(a: Tensor) -> bool:
    """The fused passes serve contiguous float32 CPU tensors only. (``is_cpu``: ``device.type`` builds
    a device object, 0.3 us, and this runs ~1000 times a step on a 150-tensor model.)"""
    return a.is_cpu and a.dtype == torch.float32 and a.is_contiguous() and library() is not None


def select(a: Tensor, thr: float, mode: str, expected: float = 1.0) -> tuple[Tensor, Tensor]:
    """Ascending indices (int64) and values of the elements of 1-D ``a`` passing ``thr``
    (``mode`` of :data:`MODES`): ``nonzero`` of the comparison and ``a`` at those indices.
    ``abs_not_lt``: the same as ``not_lt`` on ``a.abs()``, values ``|a|``, without the abs pass."""
    lib = library()
    assert lib is not None and usable(a)
    f = getattr(lib, f"ac_select_{mode}")
    return _compacted(lambda i, v, cap: f(a.data_ptr(), a.numel(), thr, i, v, cap), a.numel(), expected)


def select_upto(a: Tensor, thr: float, mode: str, cap: int) -> tuple[Tensor, Tensor] | int:
    """:func:`select` (``mode`` also ``abs_gt_signed``, ``abs_ge_signed``, ``abs_not_lt_signed``:
    signed values) where at most ``cap`` pass, else just how many pass: one pass either way."""
    lib = library()
    assert lib is not None and usable(a)
    f = getattr(lib, f"ac_select_{mode}")
    idx, vals = _compaction_buffers(cap)
    c = int(f(a.data_ptr(), a.numel(), thr, idx.data_ptr(), vals.data_ptr(), cap))
    return c if c > cap else _trimmed(idx, vals, c, cap)


def pick_pairs(vals: Tensor, idx: Tensor, thr: float, strict: bool, expected: float = 1.0) -> tuple[Tensor, Tensor] | None:
    """Of candidates at positions ``idx`` (int64) with signed float32 values ``vals``, those whose
    magnitude passes ``thr`` (``>`` where ``strict``, else ``>=``): their positions and signed values,
    in order, in one C pass: bitwise ``idx[at]`` and ``vals[at]`` for ``at`` the ``abs_gt`` /
    ``abs_ge`` :func:`select` of ``vals``. None where torch must answer."""
    lib = library()
    if (lib is None or not usable(vals) or idx.dtype != torch.int64 or idx.device.type != "cpu"
            or not idx.is_contiguous() or idx.numel() != vals.numel()):
        return None
    n, vp, ip = vals.numel(), vals.data_ptr(), idx.data_ptr()
    return _compacted(lambda i, v, cap: lib.ac_pick_pairs(vp, ip, n, thr, int(strict), i, v, cap), n, expected)


def select_signed32(a: Tensor, thr: float, expected: float = 1.0) -> tuple[Tensor, Tensor] | None:
    """``select(a, thr, "abs_gt_signed")`` with the positions as int32: a third fewer bytes written
    where a large share passes (SIDCo's first stage). None where the C passes do not serve (or ``a``
    has 2^31 elements or more)."""
    lib = library()
    if lib is None or not usable(a) or a.dim() != 1 or a.numel() >= 1 << 31:
        return None
    n = a.numel()
    return _compacted(lambda i, v, cap: lib.ac_select_abs_gt_signed32(a.data_ptr(), n, thr, i, v, cap), n, expected,
                      buffers=lambda cap: _compaction_buffers(cap, torch.int32))


def pick_pairs32(vals: Tensor, idx: Tensor, thr: float, strict: bool, expected: float = 1.0) -> tuple[Tensor, Tensor]:
    """:func:`pick_pairs` of candidates with int32 positions (:func:`select_signed32`'s): the
    positions given as int64, the same pairs."""
    lib = library()
    assert lib is not None and usable(vals) and _cpu_contiguous(idx, torch.int32) and idx.numel() == vals.numel()
    n, vp, ip = vals.numel(), vals.data_ptr(), idx.data_ptr()
    return _compacted(lambda i, v, cap: lib.ac_pick_pairs32(vp, ip, n, thr, int(strict), i, v, cap), n, expected)


def tail_levels(count: int) -> int:
    """The cascade's level width (``lp``) torch's one-thread float32 sum uses for ``count`` elements
    (:c:func:`ac_cascade_init`'s, as ``ac_tail_levels`` computes it)."""
    rows = count // 32
    return max(4, (rows - 1).bit_length() // 4) if rows > 1 else 4


class Tail(NamedTuple):
    """What :func:`tail_sum_keep` found: how many passed the threshold and their shifted sum, and the
    compacted set above the floor (int32 positions, signed values)."""
    passed: int
    total: float
    idx: Tensor
    vals: Tensor


def tail_sum_keep(a: Tensor, thr: float, floor: float, positions: Tensor | None = None, expect: int = 0,
                  expected: float = 1.0) -> Tail | None:
    """SIDCo-E's later stage in one read of ``a`` (signed values; the tensor itself, or kept
    candidates at ``positions``, int32 or int64): ``passed``, the count of ``|a| > thr`` and ``total`` =
    ``float((a.abs()[a.abs() > thr] - thr).sum())`` bitwise (torch's float32 sum, none of it
    written), and the positions (int32: ``a``'s own where ``positions`` is None) and signed values of
    ``|a| > floor`` (``floor >= thr``: where the next threshold is expected). ``expect``: the count
    the caller expects to pass ``thr`` (the cascade's levels depend on it; a wrong guess costs a
    second pass, never another answer); ``expected``: the share of ``a`` passing ``floor``, about.
    None where torch must answer (fewer than 8 pass ``thr``, other threads' sums, no C passes)."""
    lib = library()
    n = a.numel()
    if (lib is None or not usable(a) or a.dim() != 1 or not sums_like_torch() or not floor >= thr
            or not math.isfinite(thr) or not math.isfinite(floor)):
        return None
    c32 = c64 = None
    if positions is None:
        if n >= 1 << 31:
            return None
    elif _cpu_contiguous(positions, torch.int32) and positions.numel() == n:
        c32 = positions.data_ptr()
    elif _cpu_contiguous(positions, torch.int64) and positions.numel() == n and int(positions[-1:].sum()) < 1 << 31:
        c64 = positions.data_ptr()  # ascending: the last is the largest
    else:
        return None
    count, total, lp_out = ctypes.c_int64(0), ctypes.c_float(0.0), ctypes.c_int(0)
    lp = [tail_levels(expect)]

    def call(i: int, v: int, cap: int) -> int:
        while True:
            kept = int(lib.ac_tail_sum_keep(a.data_ptr(), c32, c64, n, thr, lp[0], floor, i, v, cap,
                                            ctypes.byref(count), ctypes.byref(total), ctypes.byref(lp_out)))
            if lp_out.value == lp[0]:
                return kept
            lp[0] = lp_out.value  # the count's own levels, known now

    idx, vals = _compacted(call, n, expected, buffers=lambda cap: _compaction_buffers(cap, torch.int32))
    if count.value < 8:
        return None
    return Tail(count.value, float(total.value), idx, vals)


def add_into(g: Tensor, r: Tensor, out: Tensor, subtract: bool = False) -> bool:
    """``torch.add(g, r, out=out)`` (``subtract``: ``torch.sub``) bitwise into a large buffer that
    aliases neither, streamed (see ``AC_STREAM_MIN``); False (nothing written) where torch runs."""
    lib = library()
    n = out.numel()
    if (lib is None or n < STREAM_MIN or not (usable(g) and usable(r) and usable(out)) or g.numel() != n
            or r.numel() != n or out.data_ptr() in (g.data_ptr(), r.data_ptr())):
        return False
    (lib.ac_sub if subtract else lib.ac_add)(g.data_ptr(), r.data_ptr(), out.data_ptr(), n)
    return True


def add_select(g: Tensor, r: Tensor, out: Tensor, thr: float, expected: float = 1.0,
               zeroed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``torch.add(g, r, out=out)`` (bitwise) and, from the same pass, the positions :func:`select`
    of ``out`` in mode ``abs_not_lt`` finds, with the *signed* values there (``abs_not_lt`` would
    give magnitudes): error feedback's compensation and Top-k's prefilter in one read. ``zeroed``:
    ascending int64 positions in ``[0, n)`` where ``r`` counts as +0.0 (as in :func:`add_abs_stats`;
    ``out`` is then not ``r``)."""
    lib = library()
    assert lib is not None and usable(g) and usable(r) and usable(out) and g.numel() == r.numel() == out.numel()
    n = out.numel()
    zp, zm = None, 0
    if zeroed is not None:
        assert _cpu_contiguous(zeroed, torch.int64) and zeroed.dim() == 1 and out.data_ptr() != r.data_ptr()
        zp, zm = zeroed.data_ptr(), zeroed.numel()
    return _compacted(lambda i, v, cap: lib.ac_add_select_abs_not_lt(g.data_ptr(), r.data_ptr(), out.data_ptr(), n,
                                                                     thr, i, v, cap, zp, zm), n, expected,
                      _signed_again(lib, "abs_not_lt", out, thr))


def _segments(gs: list[Tensor], n: int, *others: Tensor) -> tuple[Tensor, Tensor] | None:
    """The pointers and lengths of the 1-D pieces ``gs`` of a concatenation of ``n`` elements for the
    C passes over segments; None where they cannot read them (or a piece shares memory with one of
    ``others``, which they write or read beside)."""
    if (not gs or sum(g.numel() for g in gs) != n or not all(usable(g) for g in gs)
            or any(g.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for g in gs for o in others)):
        return None
    return (torch.tensor([g.data_ptr() for g in gs], dtype=torch.int64),
            torch.tensor([g.numel() for g in gs], dtype=torch.int64))


def add_select_segments(gs: list[Tensor], r: Tensor, out: Tensor, thr: float,
                        expected: float = 1.0) -> tuple[Tensor, Tensor] | None:
    """:func:`add_select` of ``g = torch.cat(gs)`` read from the pieces where they lie (a fusion
    bucket's gradients: no flattened copy). None (nothing written) where it cannot run."""
    lib = library()
    n = out.numel()
    seg = _segments(gs, n, out, r) if lib is not None and usable(r) and usable(out) and r.numel() == n else None
    if lib is None or seg is None or out.data_ptr() == r.data_ptr():
        return None
    ptrs, lens = seg

    def call(i: int, v: int, cap: int) -> int:
        return int(lib.ac_add_select_segments(ptrs.data_ptr(), lens.data_ptr(), len(gs), r.data_ptr(), out.data_ptr(),
                                              thr, i, v, cap))
    return _compacted(call, n, expected, _signed_again(lib, "abs_not_lt", out, thr))


class Counted(NamedTuple):
    """What :func:`add_count_select` found: how many passed the count's test, how many the list's,
    their positions and signed values (None where more than the room passed) and whether a sum is NaN."""
    counted: int
    listed: int
    idx: Tensor | None
    vals: Tensor | None
    nan: bool


def add_count_select(gs: list[Tensor], r: Tensor, out: Tensor, tc: float, tl: float, cap: int) -> Counted | None:
    """``out = torch.cat(gs) + r`` (torch.add's bits) written from the pieces where they lie, with how
    many ``|out| >= tc`` and the positions / signed values of ``|out| >= tl`` (room for ``cap``), from
    the same pass (``ac_add_count_select_segments``: Ok-Topk's compensation). None (nothing written)
    where it cannot run."""
    lib = library()
    n = out.numel()
    seg = _segments(gs, n, out, r) if lib is not None and usable(r) and usable(out) and r.numel() == n else None
    if lib is None or seg is None or out.data_ptr() == r.data_ptr():
        return None
    i, v = _compaction_buffers(cap)
    counted = torch.empty(1, dtype=torch.int64)
    nan = torch.zeros(1, dtype=torch.int32)
    c = int(lib.ac_add_count_select_segments(seg[0].data_ptr(), seg[1].data_ptr(), len(gs), r.data_ptr(),
                                             out.data_ptr(), tc, tl, i.data_ptr(), v.data_ptr(), cap,
                                             counted.data_ptr(), nan.data_ptr()))
    idx, vals = _trimmed(i, v, c, cap) if c <= cap else (None, None)
    return Counted(int(counted), c, idx, vals, bool(nan))


def sample_lines_segments(gs: list[Tensor], b: Tensor, lines: int, m: int) -> Tensor | None:
    """:func:`sample_lines` of ``torch.cat(gs)`` plus ``b``, the pieces read where they lie. None where
    torch must run."""
    lib = library()
    n = b.numel()
    seg = _segments(gs, n) if lib is not None and usable(b) else None
    if lib is None or seg is None or not (0 < m <= lines and lines * 16 <= n):
        return None
    out = torch.empty(m * 16, dtype=torch.float32)
    lib.ac_sample_lines_segments(seg[0].data_ptr(), seg[1].data_ptr(), len(gs), b.data_ptr(), lines, m,
                                 out.data_ptr())
    return out


_CASCADE_PROBES = (8, 37, 1000, 4133, 65_573, 300_007)
_cascade_state: list[bool] = []


def sums_like_torch() -> bool:
    """Whether :func:`cascade_sum` gives torch.sum's bits here: torch sums on one thread (more
    threads split the sum), and a probe of sizes that reach every level of the cascade, raw and
    absolute, matched torch once in this process (another ATen kernel would not)."""
    if torch.get_num_threads() != 1 or library() is None:
        return False
    if not _cascade_state:
        g = torch.Generator().manual_seed(12345)
        ok = True
        for n in _CASCADE_PROBES:
            x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(8) * 1e3 + 0.25
            for absolute in (False, True):
                want = (x.abs() if absolute else x).sum()
                got = torch.tensor(float(library().ac_cascade_sum(x.data_ptr(), n, int(absolute))),  # type: ignore[union-attr]
                                   dtype=torch.float32)
                ok = ok and torch.equal(got.view(torch.int32), want.view(torch.int32))
        _cascade_state.append(ok)
    return _cascade_state[0]


_F32 = struct.Struct("=f")


def f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest, ties to even; beyond float32's range, infinite), as a
    Python float."""
    try:
        return float(_F32.unpack(_F32.pack(x))[0])
    except OverflowError:  # struct refuses what rounds past float32's largest value
        return math.copysign(math.inf, x)


_div_agrees: list[bool] = []


def mean_from_sum(total: float, n: int) -> float:
    """torch's mean from its sum: the float32 sum divided by ``n`` as torch's ``div_`` by a Python
    int divides (``n`` rounded to float32, one float32 division), in Python floats: the double
    quotient of two float32 values, rounded to float32, is their float32 quotient (53 >= 2 x 24 + 2
    bits). Checked against torch once per process (else torch divides). Why: a one-element tensor,
    its division and its read-back cost ~20 us a tensor, ~7 % of EF-SignSGD's step on ResNet-50."""
    if not _div_agrees:
        g = torch.Generator().manual_seed(20261127)
        tries = [(float(t), int(m)) for t, m in zip(torch.randn(16, generator=g) * 1e3,
                                                      torch.randint(2, 1 << 30, (16,), generator=g))]
        tries += [(1e-40, 3), (3.4e38, 7), (1.0, (1 << 24) + 1), (-0.0, 5), (math.inf, 9)]
        _div_agrees.append(all(f32(f32(t) / f32(float(m))) == float(torch.tensor([t], dtype=torch.float32).div_(m))
                               for t, m in tries))
    if _div_agrees[0]:
        return f32(f32(total) / f32(float(n)))
    return float(torch.tensor([total], dtype=torch.float32).div_(n))


def cascade_sum(x: Tensor, absolute: bool = False) -> float | None:
    """``float(x.sum())`` (``absolute``: of ``x.abs()``) bitwise, or None where torch must answer."""
    if not (usable(x) and x.numel() >= 8 and sums_like_torch()):
        return None
    return float(library().ac_cascade_sum(x.data_ptr(), x.numel(), int(absolute)))  # type: ignore[union-attr]


def shifted_mean(x: Tensor, t: float, absolute: bool = False) -> float | None:
    """``float((x - t).mean())`` (``absolute``: of ``x.abs() - t``) bitwise for 1-D ``x`` (torch
    subtracts ``t`` rounded to float32, then sums and divides), from one read and no ``x - t``
    written; None where torch must answer."""
    if not (usable(x) and x.dim() == 1 and x.numel() >= 8 and sums_like_torch()):
        return None
    total = float(library().ac_cascade_sum_shifted(x.data_ptr(), x.numel(), f32(t),  # type: ignore[union-attr]
                                                   int(absolute)))
    return mean_from_sum(total, x.numel())


def abs_mean_signs(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """EF-SignSGD's ``x.abs().mean()`` (shape (1,)) and ``pack_bits(x >= 0, 1)`` from one read,
    torch's bits; None where torch must answer (see :func:`sums_like_torch`; a non-finite mean)."""
    if not (usable(x) and x.numel() >= 8 and sums_like_torch()):
        return None
    total = torch.empty(1, dtype=torch.float32)
    packed = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    library().ac_abs_sum_pack(x.data_ptr(), x.numel(), packed.data_ptr(), total.data_ptr())  # type: ignore[union-attr]
    mean = total.div_(x.numel())
    if not bool(torch.isfinite(mean)):  # a NaN's bits may depend on the order of operations
        return None
    return mean, packed


def add_cascade(g: Tensor, r: Tensor, out: Tensor, absolute: bool = False, signs: bool = False,
                owed: tuple[Tensor, float] | None = None) -> tuple[float, Tensor | None] | None:
    """``torch.add(g, r, out=out)`` (bitwise; ``out`` may be ``g``) and, from the same pass, torch's
    one-thread ``float(out.sum())`` (``absolute``: of ``out.abs()``) and, with ``signs``,
    ``pack_bits(out >= 0, 1)``: error feedback's compensation with what the compressor reads of its
    result. ``owed = (packed, s)``: the residual is ``r - decoded`` with ``decoded[i]`` ``+s`` for a
    set bit i of ``packed`` and ``-s`` otherwise (:func:`sign_residual`'s bits, never written).
    None (nothing written) where this cannot run (see :func:`sums_like_torch`)."""
    n = out.numel()
    if not (usable(g) and usable(r) and usable(out) and g.numel() == r.numel() == n >= 8 and sums_like_torch()):
        return None
    if owed is not None and not (_bytes_ok(owed[0]) and owed[0].numel() * 8 >= n):
        return None
    total = _SCRATCH.__dict__.get("total")
    if total is None:
        total = _SCRATCH.total = ctypes.c_float()  # read back as a Python float: no tensor and item() per call
    packed = torch.empty(-(-n // 8), dtype=torch.uint8) if signs else None
    pk = packed.data_ptr() if packed is not None else None
    lib = library()
    assert lib is not None
    if owed is None:
        lib.ac_add_cascade(g.data_ptr(), r.data_ptr(), out.data_ptr(), n, int(absolute), pk, ctypes.addressof(total))
    else:
        lib.ac_add_owed_cascade(g.data_ptr(), r.data_ptr(), owed[0].data_ptr(), owed[1], out.data_ptr(), n,
                                int(absolute), pk, ctypes.addressof(total))
    return float(total.value), packed


class AbsStats(NamedTuple):
    """What :func:`abs_stats` finds besides the magnitudes."""
    max: float
    min: float
    argmax: int
    mean: float | None
    """torch's mean of the magnitudes where :func:`sums_like_torch` (None otherwise)."""


def _stats_buffers() -> tuple[ctypes.Array, ctypes.Array]:
    """This thread's reused outputs of a C statistics pass: (max, min, sum) as float32 and the argmax
    (the first float also takes :func:`rth_largest_strided`'s value). ctypes arrays: two tensors and
    their ``tolist`` and ``item`` cost ~5 us a call, and these run once a tensor every step."""
    got: tuple[ctypes.Array, ctypes.Array] | None = _SCRATCH.__dict__.get("stats")
    if got is None:
        got = _SCRATCH.stats = ((ctypes.c_float * 3)(), (ctypes.c_int64 * 1)())
    return got


def _stats_of(stats: ctypes.Array, amax: ctypes.Array, n: int) -> AbsStats:
    """The :class:`AbsStats` a C statistics pass wrote into ``stats`` (max, min, sum) and ``amax``."""
    mx, mn, total = stats[0], stats[1], stats[2]
    mean = mean_from_sum(total, n) if n >= 8 and sums_like_torch() else None
    return AbsStats(mx, mn, int(amax[0]), mean)


def abs_stats(x: Tensor, out: Tensor | None) -> AbsStats | None:
    """``torch.abs(x, out=out)`` and, from the same pass, ``out``'s max, min, argmax (the first
    position of the max) and mean, bitwise torch's; with ``out`` None the statistics of |x| alone
    (one read, nothing written). None where torch must answer (a NaN; ``out`` is written)."""
    lib = library()
    assert lib is not None and usable(x) and x.numel() >= 1
    assert out is None or (usable(out) and x.numel() == out.numel())
    stats, amax = _stats_buffers()
    if lib.ac_abs_stats(x.data_ptr(), None if out is None else out.data_ptr(), x.numel(), stats, amax) != 0:
        return None
    return _stats_of(stats, amax, x.numel())


class AddStats(NamedTuple):
    """What :func:`add_abs_stats` did: ``done`` (the sum is written), the statistics of its
    magnitudes (None on a NaN) and the candidates passing the threshold: their positions and signed
    values (None when not asked, or on a NaN)."""
    done: bool
    stats: AbsStats | None = None
    cands: tuple[Tensor, Tensor] | None = None


def add_abs_stats(g: Tensor, r: Tensor, out: Tensor, thr: float | None = None, strict: bool = True,
                  expected: float = 1.0, zeroed: Tensor | None = None) -> AddStats:
    """``torch.add(g, r, out=out)`` (bitwise; ``out`` may be ``g`` when no ``thr``) and, from the same
    pass, :func:`abs_stats` of ``out`` (nothing else written) and, with a finite ``thr``, the
    positions of ``|out| > thr`` (``strict``) or ``>= thr`` as :func:`select` lists them in mode
    ``abs_gt`` / ``abs_ge``, with ``out``'s signed values there (not select's magnitudes, so that a
    payload takes its values from them): error feedback's compensation with the statistics and the
    candidates RedSync's and MSTop-k's searches read first. ``zeroed``: ascending int64 positions in
    ``[0, n)`` (the caller checks, :func:`ascending_within`) where ``r`` is read as +0.0, the
    residual's zeroing of the last sent coordinates left to this pass (``out`` must then not be
    ``r``). Not ``done`` where this cannot run (nothing written)."""
    lib = library()
    n = out.numel()
    select = thr is not None and math.isfinite(thr)
    if (lib is None or not (usable(g) and usable(r) and usable(out)) or not g.numel() == r.numel() == n >= 1
            or (select and out.data_ptr() in (g.data_ptr(), r.data_ptr()))  # a second try must not add twice
            or (zeroed is not None and (out.data_ptr() == r.data_ptr() or not _cpu_contiguous(zeroed, torch.int64)
                                        or zeroed.dim() != 1))):
        return AddStats(False)
    stats, amax = _stats_buffers()
    passed = [0]
    zp, zm = (zeroed.data_ptr(), zeroed.numel()) if zeroed is not None else (None, 0)

    def call(i: int, v: int, cap: int) -> int:
        passed[0] = int(lib.ac_add_abs_stats_select(g.data_ptr(), r.data_ptr(), out.data_ptr(), n, stats, amax,
                                                    thr if select else 0.0, int(strict), i, v, cap, zp, zm))
        return max(passed[0], 0)

    cands = None
    if thr is not None and select:
        cands = _compacted(call, n, expected, _signed_again(lib, "abs_gt" if strict else "abs_ge", out, thr))
    else:
        call(0, 0, 0)
    if passed[0] < 0:
        return AddStats(True)
    return AddStats(True, _stats_of(stats, amax, n), cands)


def _std_of(sumsq: float, n: int) -> float:
    """torch.std's float32 from its sum of squared deviations: the double division and square root,
    then the float32 rounding a torch float32 tensor's fill_ makes (:func:`f32`, without the ~6 us of
    a tensor made and read back per call)."""
    var = sumsq / (n - 1)
    return f32(math.sqrt(var)) if var >= 0 else math.nan


def std_if_decided(lanes_sum: float, n: int) -> float | None:
    """torch.std's float32 for n elements whose squared deviations summed to ``lanes_sum`` in
    :func:`std_select`'s 16 lanes, where every sum within the proven distance of it (torch's in-order
    sum among them) gives the same float32; None where it may not (or the sum is not finite)."""
    if not math.isfinite(lanes_sum):
        return None
    u, h = 2.0 ** -53, n // 16 + 67
    k = (n - 1) + h  # both chains' lengths: gamma_a + gamma_b <= gamma_(a + b)
    err = 2 * k * u / (1 - k * u) * lanes_sum / (1 - h * u / (1 - h * u))  # 2: slack for the roundings here
    return _std_between(lanes_sum - err, lanes_sum + err, n)


def _std_between(lo: float, hi: float, n: int) -> float | None:
    """torch.std's float32 for every sum of squared deviations in [lo, hi] where they all give the
    same one (division, square root and rounding are monotone, so the ends decide), else None."""
    a, b = _std_of(max(0.0, lo), n), _std_of(hi, n)
    return a if a == b else None


def std_select(x: Tensor, mean: float, thr: float, expected: float = 1.0) -> tuple[float, Tensor, Tensor] | None:
    """``float(x.std())`` given ``mean = float(x.mean())``, with the positions of ``|x| > thr``
    (:func:`select` in mode ``abs_gt``) and the signed values there from the same read: torch's bits where torch sums
    on one thread (it splits the sum across threads otherwise: None, and torch answers).

    torch's sum of the squared deviations is one chain of dependent double adds; here the same terms
    are summed in 16 lanes. Both sums are sums of the same non-negative terms, so each lies within
    gamma_k * sum of the exact sum (k: the longest chain of additions, n - 1 for torch's, n / 16 + 67
    for the lanes'); every later step (division, square root, float32 rounding) is monotone, so where
    both ends of that interval give the same float32 std, torch's gives it too. Otherwise (a sum
    within ~n * 2^-52 of a float32 rounding boundary, ~1 % of ResNet-50's largest tensors) or on a
    non-finite sum, the terms are summed again in torch's order."""
    lib = library()
    assert lib is not None and usable(x) and x.numel() >= 2
    if torch.get_num_threads() != 1:
        return None
    n = x.numel()
    total = torch.empty(1, dtype=torch.float64)
    used = ctypes.c_int(0)

    def read(lanes: int) -> Callable[[int, int, int], int]:
        return lambda i, v, cap: lib.ac_sumsq_select_abs_gt(x.data_ptr(), n, mean, thr, i, v, cap, total.data_ptr(),
                                                            lanes, ctypes.byref(used))

    idx, vals = _compacted(read(1), n, expected)
    fast = float(total.item())
    if not used.value:
        return _std_of(fast, n), idx, vals
    std = std_if_decided(fast, n)
    if std is None:
        std = std_in_order(x, mean)  # one thread here, so never None
    assert std is not None
    return std, idx, vals


class Moments(NamedTuple):
    """What :func:`add_moments_select` learns in error feedback's pass, besides the sum it writes."""
    total: float  # torch's one-thread float32 sum of the compensated tensor
    squares: float  # its sum of squares, in double lanes (within a bound, not torch's bits)
    plain: float  # its sum, in double lanes
    idx: Tensor  # the positions of |sum| > t, ascending
    vals: Tensor  # the signed sums there


def add_moments_select(g: Tensor, r: Tensor, out: Tensor, thr: float, expected: float = 1.0) -> Moments | None:
    """``torch.add(g, r, out=out)`` (bitwise) and, from the same pass, torch's one-thread
    ``float(out.sum())``, the sums of ``out ** 2`` and ``out`` in double lanes (for
    :func:`std_from_moments`) and :func:`select` of ``out`` in mode ``abs_gt`` with the signed values:
    Gaussian-k's compensation, mean, std and candidates in one read. None (nothing written) where this
    cannot run: an ``out`` aliasing ``g`` or ``r`` (a short candidate guess runs the pass again)."""
    n = out.numel()
    if not (usable(g) and usable(r) and usable(out) and g.numel() == r.numel() == n >= 64 and sums_like_torch()
            and out.data_ptr() not in (g.data_ptr(), r.data_ptr())):
        return None
    lib = library()
    assert lib is not None
    total = ctypes.c_float()
    moments = (ctypes.c_double * 2)()
    idx, vals = _compacted(lambda i, v, cap: lib.ac_add_moments_select(
        g.data_ptr(), r.data_ptr(), out.data_ptr(), n, thr, i, v, cap, ctypes.addressof(total),
        ctypes.addressof(moments)), n, expected, _signed_again(lib, "abs_gt", out, thr))
    return Moments(float(total.value), float(moments[0]), float(moments[1]), idx, vals)


def std_from_moments(squares: float, plain: float, mean: float, n: int) -> float | None:
    """torch.std's float32 (``correction=1``) of the ``n`` values whose squares and values summed to
    ``squares`` and ``plain`` in :func:`add_moments_select`'s lanes, given torch's float32 ``mean``
    of them, where it is proven; None where it is not (then a read in torch's order answers).

    torch sums the terms ``((double)x - mean)^2`` in chains of at most n - 1 adds: its sum T lies
    within gamma_(n+2) E of the exact E = sum (x - mean)^2 (gamma_3 for the rounded difference and
    square, gamma_(n-1) for the chain). E = S2 - 2 mean S1 + n mean^2 exactly, with S2 and S1 the
    exact sums: the lanes' chains (<= n / 16 + 8 adds) put the computed S2 within gamma_c S2 (exact
    squares, all non-negative) and S1 within gamma_c sum |x| <= gamma_c sqrt(n S2) (Cauchy-Schwarz),
    and the few roundings of the combination below within 5 u of its terms' magnitudes. Every step
    from T to the float32 std (division, square root, rounding) is monotone, so where both ends of
    the interval give one float32, torch's T gives it too. The interval is twice those bounds."""
    if not (math.isfinite(squares) and math.isfinite(plain) and math.isfinite(mean) and n >= 2):
        return None
    u = 2.0 ** -53

    def gamma(k: int) -> float:
        return k * u / (1 - k * u)

    c = n // 16 + 24
    e2 = gamma(c) / (1 - gamma(c)) * squares
    e1 = gamma(c) * math.sqrt(n * (squares + e2))
    a, b, d = squares, 2.0 * mean * plain, n * mean * mean
    est = (a - b) + d
    delta = 2 * (e2 + 2 * abs(mean) * e1 + 5 * u * (abs(a) + abs(b) + abs(d)))
    t = 2 * gamma(n + 2)
    lo, hi = (est - delta) * (1 - t), (est + delta) * (1 + t)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return _std_between(lo, hi, n)


def std_in_order(x: Tensor, mean: float) -> float | None:
    """``float(x.std())`` given ``mean = float(x.mean())``: torch's terms summed in torch's order
    (one thread; None otherwise, and torch answers)."""
    lib = library()
    if lib is None or not usable(x) or x.numel() < 2 or torch.get_num_threads() != 1:
        return None
    got = _SCRATCH.__dict__.get("sumsq")
    if got is None:  # read back as Python numbers: no tensor and item() per call (Gaussian-k's small tensors)
        got = _SCRATCH.sumsq = (ctypes.c_double(), ctypes.c_int())
    total, used = got
    lib.ac_sumsq_select_abs_gt(x.data_ptr(), x.numel(), mean, math.inf, None, None, 0, ctypes.addressof(total), 0,
                               ctypes.addressof(used))
    return _std_of(float(total.value), x.numel())


def _compaction_buffers(cap: int, positions: torch.dtype = torch.int64) -> tuple[Tensor, Tensor]:
    """Index and value buffers for a compaction of at most ``cap``, from this thread's pool."""
    ws = _SCRATCH.__dict__.get("compacted")
    if ws is None:
        ws = _SCRATCH.compacted = Workspace()
    cpu = torch.device("cpu")
    return ws.transfer("idx", cap, positions, cpu), ws.transfer("vals", cap, torch.float32, cpu)


def _trimmed(idx: Tensor, vals: Tensor, c: int, cap: int) -> tuple[Tensor, Tensor]:
    """The first ``c`` of a compaction's buffers; copies where the guess ``cap`` was generous, so
    small views do not keep the pool's large buffers alive."""
    return (idx[:c].clone(), vals[:c].clone()) if cap > 2 * c + 4096 else (idx[:c], vals[:c])


def _signed_again(lib: ctypes.CDLL, mode: str, out: Tensor, thr: float) -> Callable[[int, int, int], int]:
    """A fused pass's compaction taken again from the sum it wrote to ``out``: the positions of
    ``|out|`` passing ``thr`` in ``mode`` with the signed values, the set and order the pass emits."""
    f, ptr, n = getattr(lib, f"ac_select_{mode}_signed"), out.data_ptr(), out.numel()
    return lambda i, v, cap: int(f(ptr, n, thr, i, v, cap))


def _first_room(n: int, expected: float) -> int:
    """A compaction's first guess of its size: 1.5 times the ``expected`` share of ``n``, plus 1024."""
    return min(n, int(n * min(1.0, expected) * 1.5) + 1024)


def _compacted(call: Callable[[int, int, int], int], n: int, expected: float,
               again: Callable[[int, int, int], int] | None = None,
               buffers: Callable[[int], tuple[Tensor, Tensor]] = _compaction_buffers) -> tuple[Tensor, Tensor]:
    """Indices and values a compaction ``call(idx_ptr, vals_ptr, cap)`` writes (it returns how many
    passed, writing at most ``cap``); called again with the exact size when the guess was short, or
    ``again`` instead where it gives the same (a fused compensation wrote its whole sum and counted
    its candidates: one read of that sum, not the fused pass again; on real gradients a sampled
    floor passed up to 14 times its target, cost_notes item 53). ``buffers(cap)``: the two outputs
    (this thread's pool by default)."""
    cap = _first_room(n, expected)
    while True:
        # reused while nobody holds them (a search's candidates are dropped once its compressor has
        # picked): fresh multi-MB buffers here page-faulted on alternate steps (MSTop-k on VGG-16's fc6:
        # 4.6M candidates, 55 MB)
        idx, vals = buffers(cap)
        c = int(call(idx.data_ptr(), vals.data_ptr(), cap))
        if c <= cap:
            return _trimmed(idx, vals, c, cap)
        cap = c  # the guess was short: the exact count is known now
        if again is not None:
            call = again


def counter(a: Tensor, mode: str) -> Callable[[float], int] | None:
    """:func:`count` bound to 1-D ``a`` (which the caller keeps alive while it counts): searches
    count dozens of thresholds on one candidate set, and the per-call checks cost more than the
    count of a few thousand values. None where :func:`count` could not run."""
    lib = library()
    if lib is None or not usable(a):
        return None
    fn, ptr, n = getattr(lib, f"ac_count_{mode}"), a.data_ptr(), a.numel()
    return lambda thr: int(fn(ptr, n, thr))


_BAND_MODES = {"gt": 0, "ge": 1, "abs_gt": 2, "abs_ge": 3}


def bisect_band(a: Tensor, mode: str, k: int, mean: float, top: float, max_steps: int
                ) -> tuple[list[float], list[int], bool] | None:
    """RedSync's whole ratio bisection over full counts of 1-D ``a`` (``mode`` of a counter: gt, ge,
    abs_gt, abs_ge) in one C call: every step's threshold and count, and whether the last count lies
    in [k, 2k) (:meth:`~adacomp.compressors.redsync.RedSyncCompressor.threshold` picks the best
    otherwise). The same thresholds as its loop of count calls, each a Python step and a C call (~4 us
    apiece, 5-6 a small tensor: more than the counts of a few thousand values). None where it does
    not serve (a non-finite mean or max: the loop answers)."""
    lib = library()
    if lib is None or mode not in _BAND_MODES or not usable(a) or not (math.isfinite(mean) and math.isfinite(top)):
        return None
    steps = max(1, int(max_steps))
    thrs, counts, found = (ctypes.c_double * steps)(), (ctypes.c_int64 * steps)(), ctypes.c_int(0)
    m = lib.ac_bisect_band(a.data_ptr(), a.numel(), _BAND_MODES[mode], k, mean, top, steps, thrs, counts,
                           ctypes.byref(found))
    return list(thrs[:m]), list(counts[:m]), bool(found.value)


class Band(NamedTuple):
    """Where :func:`gauss_band` left Gaussian-k's correction loop: its threshold and brackets (None:
    not yet on that side), the steps it made, the counts it read, and whether the loop ended."""
    thr: float
    too_low: float | None
    too_high: float | None
    steps: int
    reads: int
    done: bool


def gauss_band(a: Tensor, mode: str, thr: float, lo: float, hi: float, max_adjust: int,
               kept: tuple[Tensor, str, float] | None = None) -> Band | None:
    """Gaussian-k's correction loop (:meth:`~adacomp.compressors.gaussiank.GaussianKCompressor.threshold`)
    from ``thr`` in one C call: over full counts of 1-D ``a`` (``mode`` of a counter), or with ``kept``
    = (the kept values, their counter's mode, the floor) over those, until a count below the floor
    needs the caller's counter (``done`` False: the loop goes on from the returned state). Why: the
    loop runs out its five counts on most tensors (error feedback's residual is not normal), a Python
    step and a C call each, more than the counts themselves on ResNet-50's smaller tensors. None where
    it does not serve."""
    lib = library()
    if lib is None or mode not in _BAND_MODES or not usable(a) or max_adjust < 1:
        return None
    if kept is not None and (kept[1] not in _BAND_MODES or not usable(kept[0])):
        return None
    st = (ctypes.c_double * 3)(thr)
    flags = (ctypes.c_int * 4)()
    vals, kmode, floor = kept if kept is not None else (a, mode, 0.0)
    steps = lib.ac_gauss_band(a.data_ptr(), a.numel(), _BAND_MODES[mode], vals.data_ptr(), vals.numel(),
                              _BAND_MODES[kmode], floor, int(kept is not None), st, flags, lo, hi, int(max_adjust))
    return Band(float(st[0]), float(st[1]) if flags[0] else None, float(st[2]) if flags[1] else None, int(steps),
                int(flags[3]), bool(flags[2]))


def gauss_whole(x: Tensor, mean: float, z: float, lo: float, hi: float, max_adjust: int, cap: int
                ) -> tuple[Tensor, Tensor] | None:
    """Gaussian-k's choice on a tensor its search counts whole (ac_gauss_whole): torch.std of 1-D ``x``
    in torch's order given ``mean`` (torch's), the threshold ``mean + std * z``, the correction loop to
    [lo, hi] over full counts (at most ``max_adjust`` steps), the positions and signed values of
    ``|x| > thr``, and where more than ``cap`` (> 0) pass, the ``cap`` largest. The same bits as
    :meth:`~adacomp.compressors.gaussiank.GaussianKCompressor.choose`'s calls one by one; None where
    that path must answer (one thread only, as :func:`std_in_order`; a threshold that is not finite
    and positive; a NaN)."""
    lib = library()
    n = x.numel()
    if lib is None or not usable(x) or n < 2 or torch.get_num_threads() != 1:
        return None
    return _capped_choice(n, cap, lambda i, v, keys, oi, ov, flag: lib.ac_gauss_whole(
        x.data_ptr(), n, mean, z, lo, hi, int(max_adjust), int(cap), i, v, keys, oi, ov, flag))


def gauss_kept(x: Tensor, vals: Tensor, idx: Tensor, floor: float, mean: float, std: float, z: float, lo: float,
               hi: float, max_adjust: int, cap: int) -> tuple[Tensor, Tensor] | None:
    """Gaussian-k's choice from its compensation's candidates (ac_gauss_kept): the signed ``vals`` at
    ascending int64 positions ``idx`` of 1-D ``x``, every one with ``|x| > floor``; the threshold
    ``mean + std * z``, the correction loop over them to [lo, hi] (at most ``max_adjust`` steps),
    those passing it, and where more than ``cap`` (> 0) pass, the ``cap`` largest. The same bits as
    :meth:`~adacomp.compressors.gaussiank.GaussianKCompressor.choose`'s calls one by one; None where
    that path must answer (a count or a threshold below the floor, a threshold that is not finite and
    positive, a NaN)."""
    lib = library()
    m = vals.numel()
    if (lib is None or not usable(x) or not usable(vals) or not _cpu_contiguous(idx, torch.int64)
            or idx.numel() != m):
        return None
    return _capped_choice(m, cap, lambda i, v, keys, oi, ov, flag: lib.ac_gauss_kept(
        x.data_ptr(), x.numel(), vals.data_ptr(), idx.data_ptr(), m, floor, mean, std, z, lo, hi, int(max_adjust),
        int(cap), i, v, keys, oi, ov, flag))


def _capped_choice(m: int, cap: int, call: Callable[[int, int, int, int, int, int], int]
                   ) -> tuple[Tensor, Tensor] | None:
    """The gauss_* calls' common frame: ``call(idx, vals, keys, out_idx, out_vals, truncated)`` (the
    addresses of the compaction buffers for ``m`` candidates, their radix keys, the ``cap`` largest's
    outputs and this thread's truncation flag) answers the count passing, or -1 where the Python
    path must answer (None); the ``cap`` largest where it truncated, else those passing."""
    idx, vals = _compaction_buffers(m)
    out_idx = torch.empty(max(cap, 0), dtype=torch.int64)
    out_vals = torch.empty(max(cap, 0), dtype=torch.float32)
    truncated = _truncated_flag()
    c = int(call(idx.data_ptr(), vals.data_ptr(), _keys(m).data_ptr(), out_idx.data_ptr(), out_vals.data_ptr(),
                 ctypes.addressof(truncated)))
    if c < 0:
        return None
    return (out_idx, out_vals) if truncated.value else _trimmed(idx, vals, c, m)


def _truncated_flag() -> ctypes.c_int:
    """This thread's int the gauss_* calls report a truncation in."""
    flag = _SCRATCH.__dict__.get("truncated")
    if flag is None:
        flag = _SCRATCH.truncated = ctypes.c_int()
    return flag


def count(a: Tensor, thr: float, mode: str) -> int:
    """Number of elements of 1-D ``a`` passing ``thr`` (``mode`` of :data:`MODES`)."""
    fn = counter(a, mode)
    assert fn is not None
    return fn(thr)


def rth_largest_strided(a: Tensor, step: int, r: int, absolute: bool = False) -> float | None:
    """The r-th largest of ``a[::step]`` (1-D ``a`` of non-negative floats; ``absolute``: of
    ``|a[::step]|``, any signs), or None where torch's path must answer (a NaN, or a negative value
    when not ``absolute``)."""
    lib = library()
    assert lib is not None and usable(a)
    m = -(-a.numel() // step)
    if not 1 <= r <= m:
        raise ValueError(f"r = {r} outside 1..{m}")
    keys = _keys(m)
    out = _stats_buffers()[0]  # the value's bits land in its first float (a tensor and item(): ~4 us a call)
    if lib.ac_rth_largest_strided(a.data_ptr(), m, step, r, keys.data_ptr(), out, int(absolute)) != 0:
        return None
    return float(out[0])


def chunk_topk(a: Tensor, rows: int, chunk: int, k: int, add: tuple[Tensor, Tensor] | None = None,
               owed: tuple[Tensor, Tensor] | None = None, hint: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """Per run of ``chunk`` elements of contiguous float32 ``a`` (``rows`` runs): the positions
    (``rows x k`` int64, ascending in each row) and values of the k largest ``|a|``, ties at the
    k-th magnitude to the lowest positions; None where torch's path must answer (a NaN). ``add =
    (g, plus)``: first ``a = g + plus`` (torch.add's bits; error feedback's compensation), each run
    just before it is read, and written whole even where None is returned. ``owed = (positions,
    values)`` (with ``add``; int64 strictly ascending positions in the runs, float32 values): ``plus``
    is read as ``plus - value`` there, the residual :func:`sub_at` would have written (Chunk-Top-k's
    residual left to this pass). ``hint``: ``rows`` int32 (contiguous, CPU), each row's k-th magnitude
    (bit pattern; 0: unknown) from the previous call on the same tensor, read as the row's candidate
    floor and overwritten with this call's: only the speed depends on it (a row's scale changes little
    from step to step; the neighbouring chunk's k-th missed on 20-80 % of the models' own gradients'
    chunks, cost_notes item 59)."""
    lib = library()
    assert lib is not None and usable(a) and a.numel() >= rows * chunk and 1 <= k <= chunk
    assert hint is None or (_cpu_contiguous(hint, torch.int32) and hint.numel() == rows)
    if add is not None:
        assert all(usable(t) and t.numel() >= rows * chunk and t.data_ptr() != a.data_ptr() for t in add)
    keys = _keys(chunk + 2 * (4 * k + 64))
    pos = torch.empty(rows, k, dtype=torch.int64)
    vals = torch.empty(rows, k, dtype=torch.float32)
    owe: tuple[Any, Any, int] = (None, None, 0)
    if owed is not None:
        assert add is not None and _cpu_contiguous(owed[0], torch.int64) and _cpu_contiguous(owed[1], torch.float32)
        assert owed[0].numel() == owed[1].numel() and (not owed[0].numel() or int(owed[0][-1]) < rows * chunk)
        owe = (owed[0].data_ptr(), owed[1].data_ptr(), owed[0].numel())
    if lib.ac_chunk_topk(a.data_ptr(), rows, chunk, k, keys.data_ptr(), pos.data_ptr(), vals.data_ptr(),
                         *((add[0].data_ptr(), add[1].data_ptr()) if add is not None else (None, None)), *owe,
                         None if hint is None else hint.data_ptr()) != 0:
        return None
    return pos, vals


def chunk_quantize(vals: Tensor, bits: int) -> tuple[Tensor, Tensor] | None:
    """Chunk-Top-k's per-row scales (max |v|) and codes (uint8, flat) of a (rows, k) float32 tensor
    of kept values in one C pass, bitwise its torch sequence; None where torch must answer."""
    lib = library()
    if lib is None or vals.dim() != 2 or not usable(vals) or not 1 <= bits <= 8:
        return None
    rows, k = vals.shape
    scales = torch.empty(rows, dtype=torch.float32)
    codes = torch.empty(rows * k, dtype=torch.uint8)
    if lib.ac_chunk_quantize(vals.data_ptr(), rows, k, (1 << bits) - 1, scales.data_ptr(), codes.data_ptr()) != 0:
        return None
    return scales, codes


def chunk_encode(pos: Tensor, vals: Tensor, bits: int, first: int, packed: Tensor, scales: Tensor,
                 indices: Tensor) -> bool:
    """One run of Chunk-Top-k's payload written in one C call: ``pos`` / ``vals`` (rows x k, int64
    in-chunk positions and float32 values), each row's scale into ``scales[:rows]``, its codes packed
    into ``packed`` from code number ``first`` on (the bytes before untouched, the byte ``first``
    falls in OR-ed), the positions as int16 into ``indices[first:first + rows k]``; bitwise
    :func:`chunk_quantize`, ``pack_bits`` of the concatenated codes and ``.to(torch.int16)`` of the
    positions (their uint16 pattern above 32767). False (codes and positions not written) where
    torch's path must answer (a NaN or an infinity, a layout the call does not take)."""
    lib = library()
    if (lib is None or bits not in PACK_BITS or pos.dim() != 2 or pos.shape != vals.shape
            or not _cpu_contiguous(pos, torch.int64) or not usable(vals) or not _cpu_contiguous(scales, torch.float32)
            or not _bytes_ok(packed) or indices.dtype != torch.int16 or not indices.is_cpu
            or not indices.is_contiguous()):
        return False
    rows, k = pos.shape
    n = rows * k
    if first < 0 or scales.numel() < rows or indices.numel() < first + n or packed.numel() * 8 < (first + n) * bits:
        return False
    scratch = _reused("chunk_codes", n, torch.uint8)
    return lib.ac_chunk_encode(pos.data_ptr(), vals.data_ptr(), rows, k, bits, first, scratch.data_ptr(),
                               scales.data_ptr(), packed.data_ptr(), indices.data_ptr() + 2 * first) == 0


def chunk_decode(indices: Tensor, codes: Tensor, bits: int, scales: Tensor, levels: Tensor, full: int,
                 k_row: int, k_tail: int, chunk: int) -> tuple[Tensor, Tensor, bool] | None:
    """Chunk-Top-k's flat positions (int64) and values (``levels[code] * scale`` of the code's chunk)
    in one pass, and whether a value is -0.0; None where torch must answer."""
    lib = library()
    kept = full * k_row + k_tail
    if (lib is None or bits not in PACK_BITS or indices.dtype != torch.int16 or indices.device.type != "cpu"
            or not indices.is_contiguous() or indices.numel() != kept or not _bytes_ok(codes)
            or codes.numel() * 8 < kept * bits or not usable(scales) or scales.numel() < full + (1 if k_tail else 0)
            or not usable(levels) or levels.numel() != 1 << bits or chunk > 1 << 16):
        return None
    pos = torch.empty(kept, dtype=torch.int64)
    vals = torch.empty(kept, dtype=torch.float32)
    negzero = lib.ac_chunk_decode(indices.data_ptr(), codes.data_ptr(), bits, scales.data_ptr(), levels.data_ptr(),
                                  full, k_row, k_tail, chunk, pos.data_ptr(), vals.data_ptr())
    return pos, vals, bool(negzero)


CHUNK_MEAN_SLAB = 1 << 18  # elements a slab of ac_chunk_mean covers: its decoded ranks stay in L2


def chunk_mean(out: Tensor, payloads: list[tuple[Tensor, Tensor, Tensor]], bits: int, levels: Tensor, full: int,
               k_row: int, k_tail: int, chunk: int, divisor: int) -> bool:
    """:func:`sparse_mean` of every rank's :func:`chunk_decode` (``payloads``: (codes, scales, int16
    indices) per rank, in rank order) into the flat float32 ``out``, decoding slab by slab in C
    without writing the decoded positions and values (the same bits). False where the caller's
    path must run: a layout the C call does not take, or a scale that could decode to -0.0 (then
    nothing was written), or positions out of order (then ``out`` may be partly written)."""
    lib = library()
    world, kept, rows = len(payloads), full * k_row + k_tail, full + (1 if k_tail else 0)
    if (lib is None or not world or bits not in PACK_BITS or not _cpu_contiguous(out, torch.float32)
            or not usable(levels) or levels.numel() != 1 << bits or not 0 < chunk <= 1 << 16):
        return False
    for codes, scales, idx in payloads:
        if (idx.dtype != torch.int16 or not idx.is_cpu or not idx.is_contiguous() or idx.numel() != kept
                or not _bytes_ok(codes) or codes.numel() * 8 < kept * bits or not usable(scales)
                or scales.numel() < rows):
            return False
    slab = max(1, CHUNK_MEAN_SLAB // chunk)
    cap = slab * k_row + k_tail
    pos = _reused("chunk_mean_pos", world * cap, torch.int64)
    vals = _reused("chunk_mean_vals", world * cap, torch.float32)
    iptr, vptr, counts, at = _pointer_arrays(world)
    ip, cp, sp = ((ctypes.c_void_p * world)(*(t.data_ptr() for t in col)) for col in
                  ([p[2] for p in payloads], [p[0] for p in payloads], [p[1] for p in payloads]))
    return lib.ac_chunk_mean(out.data_ptr(), out.numel(), world, ip, cp, sp, bits, levels.data_ptr(), full, k_row,
                             k_tail, chunk, float(divisor), slab, pos.data_ptr(), vals.data_ptr(), iptr, vptr, counts,
                             at) == 0


def chunk_means_packed(buf: Tensor, outs: list[Tensor], code_off: list[int], scale_off: list[int],
                       idx_off: list[int], layouts: list[tuple[int, Tensor, int, int, int, int]]) -> list[bool] | None:
    """:func:`chunk_mean` of many outputs in one C call, the payloads read where they lie in the
    gathered bytes ``buf``: output i (``layouts[i] = (bits, levels, full, k_row, k_tail, chunk)``)
    takes, for every rank r (``world = len(code_off) // len(outs)``, at least 2), the packed codes,
    float32 scales and int16 positions at byte ``code_off`` / ``scale_off`` / ``idx_off[i * world + r]``,
    and is divided by the world size. Why: the views and the per-entry call cost ~40 us a tensor,
    more than the C work on small tensors. Per output whether it was written (False: the caller's
    path must run; see :func:`chunk_mean`); None where no call was made."""
    lib = library()
    m = len(outs)
    if (lib is None or not m or len(code_off) % m or not len(scale_off) == len(idx_off) == len(code_off)
            or len(layouts) != m or buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous()
            or not all(_cpu_contiguous(o, torch.float32) for o in outs)):
        return None
    world, size, base = len(code_off) // m, buf.numel(), buf.data_ptr()
    if world < 2:
        return None
    slabs, caps = [], []
    for i, (bits, levels, full, k_row, k_tail, chunk) in enumerate(layouts):
        kept, rows = full * k_row + k_tail, full + (1 if k_tail else 0)
        if (bits not in PACK_BITS or not usable(levels) or levels.numel() != 1 << bits or not 0 < chunk <= 1 << 16
                or not kept or k_row > chunk or outs[i].numel() > rows * chunk):
            return None
        for at in range(i * world, (i + 1) * world):
            ic, sc, cc = idx_off[at], scale_off[at], code_off[at]
            if (ic < 0 or sc < 0 or cc < 0 or (base + ic) % 2 or (base + sc) % 4 or ic + 2 * kept > size
                    or sc + 4 * rows > size or cc + -(-kept * bits // 8) > size):
                return None
        slabs.append(max(1, CHUNK_MEAN_SLAB // chunk))
        caps.append(slabs[-1] * k_row + k_tail)
    cap = max(caps)
    pos = _reused("chunk_mean_pos", world * cap, torch.int64)
    vals = _reused("chunk_mean_vals", world * cap, torch.float32)
    iptr, vptr, counts, at_ = _pointer_arrays(world)
    status = (ctypes.c_int32 * m)()
    i64s = ctypes.c_int64 * m
    lib.ac_chunk_mean_many(m, (ctypes.c_void_p * m)(*[o.data_ptr() for o in outs]), i64s(*[o.numel() for o in outs]),
                           world, base, (ctypes.c_int64 * len(code_off))(*code_off),
                           (ctypes.c_int64 * len(code_off))(*scale_off), (ctypes.c_int64 * len(code_off))(*idx_off),
                           (ctypes.c_int32 * m)(*[L[0] for L in layouts]),
                           (ctypes.c_void_p * m)(*[L[1].data_ptr() for L in layouts]),
                           *(i64s(*[int(L[q]) for L in layouts]) for q in (2, 3, 4, 5)), i64s(*slabs), float(world),
                           (ctypes.c_void_p * world)(), (ctypes.c_void_p * world)(), (ctypes.c_void_p * world)(),
                           pos.data_ptr(), vals.data_ptr(), iptr, vptr, counts, at_, status)
    return [s == 0 for s in status]


def sub_at(out: Tensor, t: Tensor, idx: Tensor, vals: Tensor) -> bool:
    """``out[idx] = t[idx] - vals`` (flat, ``out`` may be ``t``) in C; False (nothing written) where
    torch must run."""
    lib = library()
    if (lib is None or not usable(out) or not usable(t) or t.numel() != out.numel() or not usable(vals)
            or idx.dtype != torch.int64 or idx.device.type != "cpu" or not idx.is_contiguous()
            or idx.numel() != vals.numel()):
        return False
    return lib.ac_sub_at(out.data_ptr(), t.data_ptr(), out.numel(), idx.data_ptr(), vals.data_ptr(), idx.numel()) == 0


PICK_FILTER_MIN = 4096
"""Whole tensors from this many elements are picked through a sampled floor (ac_pick_largest_filtered)."""
PICK_FILTER_RATIO = 8  # ... where at most 1/8 of them is kept (the floor aims at 3x that share)


def _pick_filtered(lib: ctypes.CDLL, mags: Tensor, k: int, flat: Tensor | None, keys: Tensor, out_idx: Tensor,
                   out_vals: Tensor) -> int:
    """ac_pick_largest_filtered: 1 picked, 0 declined (nothing written), -1 a NaN."""
    m = mags.numel()
    cap = m // 2
    cand = _reused("pick_cand", cap, torch.int64)
    return int(lib.ac_pick_largest_filtered(mags.data_ptr(), m, k, None if flat is None else flat.data_ptr(),
                                            keys.data_ptr(), cand.data_ptr(), cap, out_idx.data_ptr(),
                                            out_vals.data_ptr()))


def pick_largest(mags: Tensor, idx: Tensor | None, k: int, flat: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """:func:`~adacomp.compressors.sparse.largest_k` of candidates (ascending int64 ``idx`` into
    the tensor, or None for every position of ``mags`` itself; their float32 values ``mags``, ranked
    by magnitude) and the signed values at the kept positions, in one C call: ``flat[kept]`` when
    ``flat`` is given, else the candidates' own values (signed candidates). The same positions and
    values as ``largest_k`` then ``index_select``. None where torch must answer (a NaN, another
    dtype or device)."""
    lib = library()
    m = mags.numel()
    if (lib is None or not usable(mags) or (flat is not None and not usable(flat)) or not 1 <= k <= m
            or (idx is not None and (idx.dtype != torch.int64 or idx.device.type != "cpu"
                                     or not idx.is_contiguous() or idx.numel() != m))):
        return None
    keys = _keys(m)
    out_idx = torch.empty(k, dtype=torch.int64)
    out_vals = torch.empty(k, dtype=torch.float32)
    if idx is None and m >= PICK_FILTER_MIN and k * PICK_FILTER_RATIO <= m:
        got = _pick_filtered(lib, mags, k, flat, keys, out_idx, out_vals)
        if got:
            return None if got < 0 else (out_idx, out_vals)
    if lib.ac_pick_largest(mags.data_ptr(), None if idx is None else idx.data_ptr(), m, k,
                           None if flat is None else flat.data_ptr(),
                           keys.data_ptr(),
                           out_idx.data_ptr(), out_vals.data_ptr()) != 0:
        return None
    return out_idx, out_vals


def _cpu_contiguous(t: Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.is_cpu and t.is_contiguous()


_SCRATCH = threading.local()


def _reused(name: str, m: int, dtype: torch.dtype) -> Tensor:
    """Scratch of at least m elements for a C call that only writes and reads it, reused per
    thread (grown, never shrunk): a fresh multi-MB buffer each call cost page faults on alternate
    steps (VGG-16's fc6: 2000 faults, ~2.5 ms a step)."""
    buf = _SCRATCH.__dict__.get(name)
    if buf is None or buf.numel() < m:
        buf = torch.empty(max(m, 1 << 12), dtype=dtype)
        setattr(_SCRATCH, name, buf)
    return buf


def _keys(m: int) -> Tensor:
    """int32 scratch of m elements for a radix select's keys (:func:`_reused`)."""
    return _reused("keys", m, torch.int32)


def _pointer_arrays(world: int) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array, ctypes.Array]:
    """Reused ctypes arrays for a call over ``world`` ranks (per thread): building them fresh cost
    more than the C work on small tensors (~150 tensors, each a call per step)."""
    cache: dict[int, tuple[ctypes.Array, ctypes.Array, ctypes.Array, ctypes.Array]] = _SCRATCH.__dict__.setdefault("arrays", {})
    got = cache.get(world)
    if got is None:
        got = cache[world] = ((ctypes.c_void_p * world)(), (ctypes.c_void_p * world)(),
                              (ctypes.c_int64 * world)(), (ctypes.c_int64 * world)())
    return got


def _sparse_arrays(idx: list[Tensor], vals: list[Tensor]) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array,
                                                                   ctypes.Array] | None:
    """:func:`_pointer_arrays` filled with every rank's positions (int64) and values (float32), or
    None where a payload is not laid out for the C passes."""
    world = len(idx)
    if not world or len(vals) != world:
        return None
    iptr, vptr, counts, pos = _pointer_arrays(world)
    for r, (i, v) in enumerate(zip(idx, vals)):
        if not (_cpu_contiguous(i, torch.int64) and _cpu_contiguous(v, torch.float32)) or i.numel() != v.numel():
            return None
        iptr[r], vptr[r], counts[r] = i.data_ptr(), v.data_ptr(), i.numel()
    return iptr, vptr, counts, pos


def sparse_mean(out: Tensor, idx: list[Tensor], vals: list[Tensor], divisor: int) -> bool:
    """``out`` = zeros, every rank's ``vals[r]`` added at ``idx[r]`` in rank order, divided by
    ``divisor`` at the touched positions, in one sequential write (bitwise ``zero_``, ``index_add_``
    of the concatenated payloads, ``div_``). False where the torch path must run (another dtype,
    a layout it does not take, positions not strictly ascending: then ``out`` may be partly written)."""
    lib = library()
    arrays = _sparse_arrays(idx, vals)
    if lib is None or arrays is None or not _cpu_contiguous(out, torch.float32):
        return False
    iptr, vptr, counts, pos = arrays
    return lib.ac_sparse_mean(out.data_ptr(), out.numel(), len(idx), iptr, vptr, counts, pos, float(divisor)) == 0


def sparse_sample_lines(r: Tensor, idx: list[Tensor], vals: list[Tensor], divisor: int, lines: int,
                        m: int) -> Tensor | None:
    """:func:`sample_lines` of ``a + r`` where ``a`` is what :func:`sparse_mean` would write from the
    payloads (the same floats), without writing ``a``; None where the C pass cannot run (then nothing
    was sampled)."""
    lib = library()
    arrays = _sparse_arrays(idx, vals)
    if lib is None or arrays is None or not usable(r):
        return None
    out = torch.empty(16 * m, dtype=torch.float32)
    iptr, vptr, counts, pos = arrays
    if lib.ac_sparse_sample_lines(r.data_ptr(), r.numel(), len(idx), iptr, vptr, counts, pos, float(divisor),
                                  lines, m, out.data_ptr()) != 0:
        return None
    return out


def sparse_mean_add_select(r: Tensor, out: Tensor, idx: list[Tensor], vals: list[Tensor], divisor: int, thr: float,
                           expected: float = 1.0) -> tuple[Tensor, Tensor] | None:
    """``out = a + r`` with ``a`` the ranks' mean :func:`sparse_mean` would write (never written
    itself) and, from the same pass, what :func:`add_select` would find in ``out``: the divisible
    scheme's second compensation from the received payloads in one pass. None (nothing written)
    where it cannot run: a layout it does not take, positions not strictly ascending."""
    lib = library()
    arrays = _sparse_arrays(idx, vals)
    n = out.numel()
    if lib is None or arrays is None or not (usable(r) and usable(out)) or r.numel() != n \
            or out.data_ptr() == r.data_ptr():
        return None
    iptr, vptr, counts, pos = arrays
    refused: list[bool] = []

    def call(i: int, v: int, cap: int) -> int:
        got = int(lib.ac_sparse_mean_add_select(r.data_ptr(), out.data_ptr(), n, len(idx), iptr, vptr, counts, pos,
                                                float(divisor), thr, i, v, cap))
        if got < 0:
            refused.append(True)
            return 0
        return got

    got = _compacted(call, n, expected)
    return None if refused else got


def sparse_means_packed(buf: Tensor, outs: list[Tensor], idx_off: list[int], val_off: list[int],
                        counts: list[int], divisor: int) -> list[bool] | None:
    """:func:`sparse_mean` of many outputs in one C call, the payloads read where they lie in the
    gathered bytes ``buf``: output i takes, for every rank r (``world = len(counts) // len(outs)``),
    ``counts[i * world + r]`` int64 positions at byte ``idx_off[i * world + r]`` and as many float32
    values at ``val_off[...]``. Why: the views, checks and call of :func:`sparse_mean` cost ~20 us per
    tensor, more than the C work on ResNet-50's small tensors. Returns, per output, whether it was
    written (False: nothing was, the torch path must run); None where no call was made."""
    lib = library()
    m = len(outs)
    if lib is None or not m or len(counts) % m or buf.dtype != torch.uint8 or buf.device.type != "cpu" \
            or not buf.is_contiguous():
        return None
    world, size, base = len(counts) // m, buf.numel(), buf.data_ptr()
    for io, vo, c in zip(idx_off, val_off, counts):
        if c < 0 or io < 0 or vo < 0 or (base + io) % 8 or (base + vo) % 4 or io + 8 * c > size or vo + 4 * c > size:
            return None
    if not all(_cpu_contiguous(o, torch.float32) for o in outs):
        return None
    iptr, vptr, _, pos = _pointer_arrays(world)
    status = (ctypes.c_int32 * m)()
    lib.ac_sparse_mean_many(m, (ctypes.c_void_p * m)(*[o.data_ptr() for o in outs]),
                            (ctypes.c_int64 * m)(*[o.numel() for o in outs]), world, base,
                            (ctypes.c_int64 * len(idx_off))(*idx_off), (ctypes.c_int64 * len(val_off))(*val_off),
                            (ctypes.c_int64 * len(counts))(*counts), iptr, vptr, pos, float(divisor), status)
    return [s == 0 for s in status]


def sign_means_packed(buf: Tensor, outs: list[Tensor], scale_off: list[int], bits_off: list[int]) -> bool:
    """EF-SignSGD's :meth:`mean_into` of many outputs in one C call, the payloads read where they lie
    in the gathered bytes ``buf``: output i takes, for every rank r (``world = len(scale_off) //
    len(outs)``, at least 2), the float32 scale at byte ``scale_off[i * world + r]`` and the packed
    signs (one bit an element) at ``bits_off[...]``. False (nothing written) where it cannot run."""
    lib = library()
    m = len(outs)
    if (lib is None or not m or len(scale_off) % m or len(bits_off) != len(scale_off) or buf.dtype != torch.uint8
            or buf.device.type != "cpu" or not buf.is_contiguous() or not all(usable(o) for o in outs)):
        return False
    world, size = len(scale_off) // m, buf.numel()
    if world < 2 or any(so < 0 or so + 4 > size for so in scale_off) or any(
            bo < 0 or bo + -(-o.numel() // 8) > size for i, o in enumerate(outs) for bo in bits_off[i * world:(i + 1) * world]):
        return False
    lib.ac_sign_mean_many(m, (ctypes.c_void_p * m)(*[o.data_ptr() for o in outs]),
                          (ctypes.c_int64 * m)(*[o.numel() for o in outs]), world, buf.data_ptr(),
                          (ctypes.c_int64 * len(scale_off))(*scale_off), (ctypes.c_int64 * len(bits_off))(*bits_off),
                          (ctypes.c_uint64 * world)(), (ctypes.c_uint64 * world)(), (ctypes.c_float * (2 * world))())
    return True


def qsgd_means_packed(buf: Tensor, outs: list[Tensor], norm_off: list[int], code_off: list[int], sizes: list[int],
                      bits: list[int], levels: list[int]) -> bool:
    """QSGD's :meth:`mean_into` of many outputs in one C call, the payloads read where they lie in
    the gathered bytes ``buf``: output i (buckets of ``sizes[i]`` elements, ``bits[i]``-bit codes,
    ``levels[i]`` = s) takes, for every rank r (``world = len(norm_off) // len(outs)``, at least 2),
    the float32 bucket norms at byte ``norm_off[i * world + r]`` and the packed codes at
    ``code_off[...]``. False (nothing written) where it cannot run."""
    lib = library()
    m = len(outs)
    if (lib is None or not m or len(norm_off) % m or len(code_off) != len(norm_off) or buf.dtype != torch.uint8
            or buf.device.type != "cpu" or not buf.is_contiguous() or not all(usable(o) for o in outs)
            or not len(sizes) == len(bits) == len(levels) == m or any(b not in PACK_BITS for b in bits)):
        return False
    world, size = len(norm_off) // m, buf.numel()
    nbs = [-(-o.numel() // z) for o, z in zip(outs, sizes)]
    if world < 2 or any(not 0 <= off[i * world + r] <= size - need
                        for i, o in enumerate(outs) for r in range(world)
                        for off, need in ((norm_off, 4 * nbs[i]), (code_off, -(-o.numel() * bits[i] // 8)))):
        return False
    scratch = torch.empty(world * max(nb << b for nb, b in zip(nbs, bits)), dtype=torch.float32)
    lib.ac_qsgd_mean_many(m, (ctypes.c_void_p * m)(*[o.data_ptr() for o in outs]),
                          (ctypes.c_int64 * m)(*[o.numel() for o in outs]), (ctypes.c_int64 * m)(*sizes),
                          (ctypes.c_int32 * m)(*bits), (ctypes.c_int32 * m)(*levels), world, buf.data_ptr(),
                          (ctypes.c_int64 * len(norm_off))(*norm_off), (ctypes.c_int64 * len(code_off))(*code_off),
                          (ctypes.c_uint64 * world)(), (ctypes.c_uint64 * world)(), scratch.data_ptr())
    return True


def copy_many(buf: Tensor, tensors: list[Tensor], offsets: list[int]) -> bool:
    """Each of ``tensors`` (contiguous, on the CPU) copied byte for byte into the uint8 ``buf`` at its
    offset (ascending, not overlapping), every other byte of ``buf`` zeroed, in one C call; False
    (nothing written) where torch must copy."""
    lib = library()
    if lib is None or buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
        return False
    sizes = [t.numel() * t.element_size() for t in tensors]
    ends = [o + n for o, n in zip(offsets, sizes)]
    if (any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or any(o < e for o, e in zip(offsets[1:], ends)) or (offsets and offsets[0] < 0)
            or any(e > buf.numel() for e in ends)):
        return False
    m = len(tensors)
    lib.ac_copy_many(buf.data_ptr(), buf.numel(), m, (ctypes.c_void_p * m)(*[t.data_ptr() for t in tensors]),
                     (ctypes.c_int64 * m)(*offsets), (ctypes.c_int64 * m)(*sizes))
    return True


def zero_at(out: Tensor, idx: Tensor) -> bool:
    """``out.view(-1).index_fill_(0, idx, 0)`` in C; False (nothing written) where torch must run."""
    lib = library()
    if (lib is None or not usable(out) or idx.dtype != torch.int64 or idx.device.type != "cpu"
            or not idx.is_contiguous()):
        return False
    return lib.ac_zero_at(out.data_ptr(), out.numel(), idx.data_ptr(), idx.numel()) == 0


def take_grouped(x: Tensor, idx: Tensor) -> Tensor:
    """The values of ``x.reshape(-1)`` at ``idx`` in an order of their own (the same multiset as
    :func:`take`'s, repeats kept): read region by region, for a sample that only feeds an order
    statistic (DGC's threshold); :func:`take` where the C call does not serve or the sample is
    small."""
    flat = x.reshape(-1)
    lib = library()
    if (lib is None or idx.numel() < GROUPED_TAKE_MIN or not usable(flat) or idx.dtype != torch.int64
            or not idx.is_cpu or idx.dim() != 1 or not idx.is_contiguous()):
        return take(x, idx)
    out = torch.empty(idx.numel(), dtype=torch.float32)
    counts = _reused("take_counts", (flat.numel() >> TAKE_GROUP_SHIFT) + 2, torch.int64)
    pos = _reused("take_pos", idx.numel(), torch.int64)
    if lib.ac_take_grouped(flat.data_ptr(), flat.numel(), idx.data_ptr(), idx.numel(), TAKE_GROUP_SHIFT,
                           counts.data_ptr(), pos.data_ptr(), out.data_ptr()) == 0:
        return out
    return flat.index_select(0, idx)  # raises on the position out of range


GROUPED_TAKE_MIN = 1 << 14
"""Samples from this size are read grouped by region (below it the draws fall on few pages anyway)."""

TAKE_GROUP_SHIFT = 20
"""log2 of the region size (elements) of :func:`take_grouped` (4 MB regions: 2^20 random reads over
2^27 floats 9-11 ms on the Xeon, 10.5 at 2^14 and 2^18)."""


def take(x: Tensor, idx: Tensor) -> Tensor:
    """``x.reshape(-1).index_select(0, idx)`` (a copy: the same bits), in C with the loads prefetched
    where ``x`` is float32 (:func:`usable`) and ``idx`` a contiguous int64 CPU tensor; torch's
    gather otherwise, which also raises on a position out of range."""
    flat = x.reshape(-1)
    lib = library()
    if (lib is not None and usable(flat) and idx.dtype == torch.int64 and idx.device.type == "cpu"
            and idx.dim() == 1 and idx.is_contiguous()):
        out = torch.empty(idx.numel(), dtype=torch.float32)
        if lib.ac_take(flat.data_ptr(), flat.numel(), idx.data_ptr(), idx.numel(), out.data_ptr()) == 0:
            return out
    return flat.index_select(0, idx)


def row_candidates(x: Tensor, r: int, blocks: int, tiny: float, expected: float, limit: int,
                   add: tuple[Tensor, Tensor] | None = None,
                   signed: bool = False) -> tuple[Tensor, Tensor, int, Tensor] | None:
    """ADTopk's candidates of the (m, n) float32 ``x`` row by row in one read: each row's floor is the
    ``r``-th largest of its strided block maxima of |x| (block j: columns j, j + blocks, ... below
    ``blocks * (n // blocks)``; :func:`row_kth`),
    at least ``tiny``, infinity where a maximum is NaN; then :func:`select_rows` of |x| against it
    ("abs_ge", or "abs_not_lt" where ``blocks`` does not divide n). Returns ascending flat indices,
    their |x|, the count (indices and values left empty above ``limit``) and per row a uint8 flag: 1
    where its floor was NaN, 2 where every element is +-0 (``blocks`` dividing n), else 0; None where
    torch must answer. ``add = (g, plus)``: first write ``x = g + plus`` (torch.add's
    bits; error feedback's compensation), each row just before it is read: one pass over the model less.
    ``signed``: the values are the signed elements (a payload's, without a gather later)."""
    lib = library()
    if lib is None or x.dim() != 2 or not usable(x) or not 1 <= r <= blocks <= x.shape[1]:
        return None
    if add is not None and not all(usable(t) and t.numel() == x.numel() and t.data_ptr() != x.data_ptr() for t in add):
        return None
    gp, pp = (add[0].data_ptr(), add[1].data_ptr()) if add is not None else (None, None)
    m, n = x.shape
    keys = torch.empty(blocks, dtype=torch.int32)
    bad = torch.empty(m, dtype=torch.uint8)
    cap = min(m * n, int(m * n * min(1.0, expected) * 1.5) + 1024)
    while True:
        idx = torch.empty(cap, dtype=torch.int64)
        vals = torch.empty(cap, dtype=torch.float32)
        c = int(lib.ac_row_candidates(x.data_ptr(), m, n, blocks, r, tiny, keys.data_ptr(), bad.data_ptr(),
                                      idx.data_ptr(), vals.data_ptr(), cap, gp, pp, int(signed)))
        if c <= cap:
            return idx[:c], vals[:c], c, bad
        if c > limit:
            return idx[:0], vals[:0], c, bad
        cap = c


class RowStats(NamedTuple):
    """:func:`row_order_stats`' answer: (m, 3) order statistics, per-row candidate counts (int64)
    and whether a row's candidates hold a NaN (bool)."""
    stats: Tensor
    counts: Tensor
    nan: Tensor


def row_order_stats(mag: Tensor, row: Tensor, m: int, q: int, n: int) -> RowStats | None:
    """Each row's (q+2)-th, (q+1)-th and q-th largest candidate magnitude ((m, 3) float32, -1 where it
    has fewer), from ``mag`` grouped by ``row`` (non-decreasing, each row's candidates at most ``n``),
    ranked by their bits as an integer sort of them would rank them; with each row's count
    (``torch.bincount(row, minlength=m)``) and NaN flag, from the same walk. None where torch must
    sort (rows not grouped, another layout)."""
    lib = library()
    if (lib is None or not usable(mag) or row.dtype != torch.int64 or row.device.type != "cpu"
            or not row.is_contiguous() or row.numel() != mag.numel() or q < 1):
        return None
    keys = _keys(max(1, n) + 8)  # the rank count reads whole vectors of 8
    out = torch.empty(m, 3, dtype=torch.float32)
    counts = torch.empty(m, dtype=torch.int64)
    nan = torch.empty(m, dtype=torch.bool)
    if lib.ac_row_order_stats(mag.data_ptr(), row.data_ptr(), mag.numel(), m, q, keys.data_ptr(), out.data_ptr(),
                              counts.data_ptr(), nan.data_ptr()) != 0:
        return None
    return RowStats(out, counts, nan)


def row_chosen(mag: Tensor, flat: Tensor, row: Tensor, thr: Tensor, chose: Tensor) -> Tensor | None:
    """``flat[chose[row] & (mag >= thr[row])]`` (ADTopk's kept candidates, in their order) in one C
    pass instead of two gathers, a compare, an and and a masked select over every candidate. None
    where torch must answer."""
    lib = library()
    nc, m = flat.numel(), thr.numel()
    if (lib is None or not usable(mag) or not usable(thr) or chose.dtype != torch.bool or not chose.is_contiguous()
            or chose.numel() != m or any(t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous()
                                         or t.numel() != nc for t in (flat, row)) or mag.numel() != nc):
        return None
    out = torch.empty(nc, dtype=torch.int64)
    w = int(lib.ac_row_chosen(mag.data_ptr(), flat.data_ptr(), row.data_ptr(), nc, m, thr.data_ptr(),
                              chose.data_ptr(), out.data_ptr()))
    return out[:w].clone() if 0 <= w < nc // 2 else (out[:w] if w >= 0 else None)


class RowFinish(NamedTuple):
    """:func:`row_finish`'s answer: the chosen positions (ascending), their values (signed
    candidates only) and, where rows tied at their cut were left out, their flags (1: the row takes
    q, 2: q + 1; else None)."""

    idx: Tensor
    vals: Tensor | None
    tied: Tensor | None


def row_finish(vals: Tensor, flat: Tensor, bad: Tensor, m: int, q: int, r: int, n: int, signed: bool = False,
               x: Tensor | None = None, zero_cols: Tensor | None = None) -> RowFinish | None:
    """ADTopk's selection from a tensor's candidates (ascending positions ``flat`` in the (m, n)
    view, their ``vals``: magnitudes, or the signed values where ``signed``; ``bad`` rows (m,): bool,
    or :func:`row_candidates`' flags, whose 2 marks an all-zero row) in one C call, bitwise what
    fast_row_topk's torch sequence chooses (the same set, ascending): each row's q (+1 in the r
    rows with the largest (q+1)-th magnitude, torch.topk's choice where they tie) largest; with
    their signed values where ``signed`` (else None). An all-zero row (a dead unit's) takes
    ``zero_cols`` (:func:`adacomp.compressors._rowtopk._zero_row_cols`) with ``x``'s values there.
    A row tied at its cut is left out and flagged in ``tied`` (1: it takes q, 2: q + 1) for the
    caller's torch.topk. None where a row needs torch.topk otherwise (a NaN, too few candidates) or
    the layout does not fit: the caller's general path answers."""
    lib = library()
    nc = flat.numel()
    if (lib is None or not usable(vals) or vals.numel() != nc or bad.dtype not in (torch.bool, torch.uint8)
            or not bad.is_contiguous() or bad.numel() != m or flat.dtype != torch.int64 or not flat.is_cpu
            or not flat.is_contiguous()):
        return None
    zeros = (x is not None and zero_cols is not None and usable(x) and x.numel() == m * n
             and zero_cols.dtype == torch.int64 and zero_cols.is_contiguous()
             and zero_cols.numel() == (2 * q + 1 if r else q))
    cap = nc + (m * (q + 1) if zeros else 0)
    keys = _keys(max(m, n) + 8)
    rows = _reused("finish_rows", nc, torch.int64)
    stats = torch.empty(3 * m, dtype=torch.float32)
    counts = torch.empty(m, dtype=torch.int64)
    nan = torch.empty(m, dtype=torch.uint8)
    thr = torch.empty(m, dtype=torch.float32)
    out = torch.empty(cap, dtype=torch.int64)
    out_vals = torch.empty(cap, dtype=torch.float32) if signed else None
    tied = torch.empty(m, dtype=torch.uint8)
    ntied = ctypes.c_int64(0)
    extra: Tensor | None = None
    for _ in range(2):  # a second call where the rows taking one more tie: with torch.topk's choice of them
        w = int(lib.ac_row_finish(vals.data_ptr(), flat.data_ptr(), nc, m, n, q, r, int(signed), bad.data_ptr(),
                                  keys.data_ptr(), rows.data_ptr(), stats.data_ptr(), counts.data_ptr(),
                                  nan.data_ptr(), thr.data_ptr(), out.data_ptr(),
                                  out_vals.data_ptr() if out_vals is not None else None,
                                  x.data_ptr() if zeros and x is not None else None,
                                  zero_cols.data_ptr() if zeros and zero_cols is not None else None,
                                  extra.data_ptr() if extra is not None else None, tied.data_ptr(),
                                  ctypes.byref(ntied)))
        if w != -3 or extra is not None:
            break
        extra = torch.zeros(m, dtype=torch.uint8)  # as fast_row_topk's torch sequence picks them
        extra[torch.topk(stats.view(m, 3)[:, 1], r, sorted=False).indices] = 1
    if w < 0:
        return None
    tied_rows = tied if ntied.value else None
    if w < cap // 2:
        return RowFinish(out[:w].clone(), out_vals[:w].clone() if out_vals is not None else None, tied_rows)
    return RowFinish(out[:w], out_vals[:w] if out_vals is not None else None, tied_rows)


def row_kth(a: Tensor, r: int) -> Tensor | None:
    """``torch.topk(a, r, dim=1).values.amin(1)`` of a (rows, b) float32 CPU matrix of magnitudes
    (>= 0), bitwise (a row holding a NaN gives NaN; a zero's sign may differ: callers clamp it
    away), in one C call instead of torch's per-row topk (~10 ns per element on short rows).
    None where torch must answer."""
    lib = library()
    if lib is None or a.dim() != 2 or not usable(a) or not 1 <= r <= a.shape[1]:
        return None
    out = torch.empty(a.shape[0], dtype=torch.float32)
    keys = torch.empty(a.shape[1], dtype=torch.int32)
    lib.ac_row_kth(a.data_ptr(), a.shape[0], a.shape[1], r, keys.data_ptr(), out.data_ptr())
    return out


def _seq_inputs(matrix: Tensor, f: Tensor) -> bool:
    return (library() is not None and matrix.dim() == 2 and f.dim() == 2 and usable(matrix)
            and f.dtype == torch.float32 and f.device.type == "cpu" and 1 <= f.shape[1] <= 8)


def seq_serves(matrix: Tensor, f: Tensor) -> bool:
    """Whether :func:`mm_seq` / :func:`mtm_seq` run in C for these operands (else they answer None
    and the caller's torch product stands for every order)."""
    return _seq_inputs(matrix, f)


SEQ_BLOCKS = (0, 384)
"""The summation orders :func:`mm_seq`, :func:`mtm_seq` and :func:`owed_mm` can form (``block``):
0, every output one chain from +0 of IEEE products then additions, terms in order (torch's CPU
kernels on the 2-core EPYC); 384, fma chains over blocks of 384 terms (the last 768 or fewer in
two halves, the first the longer), the blocks' sums added in order (MKL's AVX-512 sgemm on a Xeon,
found by comparing candidate orders with its bits; every ResNet-50 and GPT-2-small layout)."""


def _run_seq(fname: str, matrix: Tensor, f: Tensor, out: Tensor, block: int) -> Tensor:
    if block not in SEQ_BLOCKS:
        raise ValueError(f"block must be one of {SEQ_BLOCKS}, got {block!r}")
    fc = f.contiguous()  # held through the call
    getattr(library(), fname)(matrix.data_ptr(), matrix.shape[0], matrix.shape[1], fc.data_ptr(), f.shape[1],
                              out.data_ptr(), block)
    return out


def mm_seq(matrix: Tensor, q: Tensor, block: int = 0) -> Tensor | None:
    """``matrix @ q`` (n x m times m x r, r <= 8) summed along each row in the order ``block``
    names (:data:`SEQ_BLOCKS`: how torch's CPU matmul formed it for a narrow ``q`` on the machines
    seen; the caller checks the bits per layout), in one read of ``matrix``; None where it cannot run."""
    if not _seq_inputs(matrix, q) or q.shape[0] != matrix.shape[1]:
        return None
    return _run_seq("ac_mm_seq", matrix, q, torch.empty(matrix.shape[0], q.shape[1], dtype=torch.float32), block)


def mtm_seq(matrix: Tensor, f: Tensor, block: int = 0) -> Tensor | None:
    """``matrix.t() @ f`` (n x m, f n x r, r <= 8) summed like :func:`mm_seq` down the columns
    (block 0: how torch.mv formed ``matrix.t() @ f[:, j]``; checked per layout by the caller), all r
    columns in one read of ``matrix``; (m, r) contiguous, or None where it cannot run."""
    if not _seq_inputs(matrix, f) or f.shape[0] != matrix.shape[0]:
        return None
    out = _run_seq("ac_mtm_seq", matrix, f, torch.empty(f.shape[1], matrix.shape[1], dtype=torch.float32), block)
    return out.t().contiguous()


def outer_fma(p: Tensor, q: Tensor, out: Tensor) -> bool:
    """``out = p @ q.t()`` as fmaf chains over the rank from a +0 accumulator (how MKL's sgemm forms
    these on x86 with FMA; the caller checks the bits per layout). False where it cannot run."""
    lib = library()
    if (lib is None or p.dim() != 2 or q.dim() != 2 or p.shape[1] != q.shape[1] or p.dtype != torch.float32
            or p.device.type != "cpu" or q.dtype != torch.float32 or q.device.type != "cpu" or not usable(out)
            or tuple(out.shape) != (p.shape[0], q.shape[0])):
        return False
    p = p.contiguous()  # n x r (QR's factor is column-major): small
    qt = q.t().contiguous()
    lib.ac_outer_fma(p.data_ptr(), qt.data_ptr(), p.shape[0], q.shape[0], p.shape[1], out.data_ptr())
    return True


def outer_fma_sub(a: Tensor, p: Tensor, q: Tensor, out: Tensor, g: Tensor | None = None) -> bool:
    """``out = a - p @ q.t()`` with each product the fma chain :func:`outer_fma` forms (bitwise
    ``torch.sub`` of ``a`` and that output) without writing the product. With ``g``:
    ``out = g + (a - p @ q.t())``, that residual then ``torch.add(g, residual)`` (error feedback's
    next compensation with the residual never written). False where it cannot run."""
    lib = library()
    shape = (p.shape[0], q.shape[0]) if p.dim() == 2 and q.dim() == 2 else None
    if (lib is None or shape is None or p.shape[1] != q.shape[1] or p.dtype != torch.float32 or q.dtype != torch.float32
            or p.device.type != "cpu" or q.device.type != "cpu" or not usable(out) or not usable(a)
            or tuple(out.shape) != shape or tuple(a.shape) != shape
            or (g is not None and (not usable(g) or tuple(g.shape) != shape))):
        return False
    pc, qt = p.contiguous(), q.t().contiguous()
    lib.ac_outer_fma_sub(pc.data_ptr(), qt.data_ptr(), a.data_ptr(), None if g is None else g.data_ptr(),
                         shape[0], shape[1], p.shape[1], out.data_ptr())
    return True


def owed_mm(g: Tensor, a: Tensor, p0: Tensor, q0: Tensor, out: Tensor, q: Tensor, block: int = 0) -> Tensor | None:
    """``out = g + (a - p0 @ q0.t())`` (:func:`outer_fma_sub` with ``g``) and, from the same pass,
    ``out @ q`` as :func:`mm_seq` forms it in the order ``block`` (n x m matrices, factors with r <= 8 columns): a low-rank
    compressor's compensation and its first product, the matrix read back from cache. None (nothing
    written) where it cannot run."""
    lib = library()
    shape = (p0.shape[0], q0.shape[0]) if p0.dim() == 2 and q0.dim() == 2 else None
    if (lib is None or shape is None or p0.shape[1] != q0.shape[1] or not _cpu_contiguous(p0, torch.float32)
            or not _cpu_contiguous(q0, torch.float32) or not all(usable(t) and tuple(t.shape) == shape for t in (g, a, out))
            or not _seq_inputs(out, q) or q.shape[0] != shape[1] or block not in SEQ_BLOCKS):
        return None
    qt0, qc = q0.t().contiguous(), q.contiguous()
    prod = torch.empty(shape[0], q.shape[1], dtype=torch.float32)
    if lib.ac_owed_mm(p0.data_ptr(), qt0.data_ptr(), p0.shape[1], a.data_ptr(), g.data_ptr(), shape[0], shape[1],
                      out.data_ptr(), qc.data_ptr(), q.shape[1], prod.data_ptr(), block) != 0:
        return None
    return prod


def sample_lines(a: Tensor, b: Tensor | None, lines: int, m: int, zeroed: Tensor | None = None) -> Tensor | None:
    """``m`` runs of 16 elements at lines :func:`~adacomp.compressors.sparse.sample_starts` of 1-D ``a`` (plus the same of ``b``,
    added): :func:`adacomp.compressors.sparse.sample_lines` in one C call. ``zeroed``: ascending int64
    positions where ``b`` counts as +0.0 (see :func:`add_abs_stats`). None where torch runs."""
    lib = library()
    if lib is None or not usable(a) or (b is not None and (not usable(b) or b.numel() != a.numel())):
        return None
    if not (0 < m <= lines and lines * 16 <= a.numel()):
        return None
    out = torch.empty(m * 16, dtype=torch.float32)
    if zeroed is not None:
        if b is None or not _cpu_contiguous(zeroed, torch.int64):
            return None
        lib.ac_sample_lines_zeroed(a.data_ptr(), b.data_ptr(), lines, m, out.data_ptr(), zeroed.data_ptr(),
                                   zeroed.numel())
        return out
    lib.ac_sample_lines(a.data_ptr(), None if b is None else b.data_ptr(), lines, m, out.data_ptr())
    return out


def first_distinct(draws: Tensor, n: int, k: int) -> tuple[Tensor, int] | None:
    """The first k distinct values of int64 ``draws`` (in ``[0, n)``) in draw order, ascending, and
    how many distinct values there were (fewer than k: all of them). None where torch must run."""
    lib = library()
    if (lib is None or draws.dtype != torch.int64 or draws.device.type != "cpu" or not draws.is_contiguous()
            or k < 1):
        return None
    bitmap = torch.zeros(-(-n // 64), dtype=torch.int64)
    out = torch.empty(k, dtype=torch.int64)
    c = int(lib.ac_first_distinct(draws.data_ptr(), draws.numel(), n, k, bitmap.data_ptr(), out.data_ptr()))
    if c < 0:
        return None
    return out[:c], c


def sign_residual(t: Tensor, packed: Tensor, s: float, out: Tensor) -> bool:
    """``torch.sub(t, decoded, out=out)`` where ``decoded[i]`` is ``+s`` for a set bit i of
    ``packed`` and ``-s`` otherwise (EF-SignSGD's residual), in one pass without the decoded tensor;
    False where torch must run."""
    n = t.numel()
    if not (usable(t) and usable(out) and out.numel() == n and _bytes_ok(packed) and packed.numel() * 8 >= n):
        return False
    library().ac_sign_residual(t.data_ptr(), packed.data_ptr(), s, out.data_ptr(), n)  # type: ignore[union-attr]
    return True


_bf16_agrees: bool | None = None


def _bf16_checked() -> bool:
    """Whether ac_to_bf16 rounds as this torch's ``.to(torch.bfloat16)`` does (every NaN, infinities,
    subnormals, ties at both parities and random bit patterns): checked once per process."""
    global _bf16_agrees
    lib = library()
    if lib is None:  # not cached: ADACOMP_NATIVE=0 may be a passing switch
        return False
    if _bf16_agrees is None:
        ok = True
        g = torch.Generator().manual_seed(20261126)
        special = [0x7fc00000, 0xffc00000, 0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0xff812345,
                   0x7fffffff, 0x00000001, 0x807fffff, 0x00008000, 0x00018000, 0x3f808000, 0x3f818000,
                   0x3f807fff, 0x7f7fffff, 0xff7f8000, 0x7f7f8000]
        bits_ = torch.cat([torch.tensor(special, dtype=torch.int64),
                           torch.randint(0, 1 << 32, (1 << 16,), generator=g, dtype=torch.int64),
                           torch.tensor(special, dtype=torch.int64)])
        x = bits_.to(torch.int32).view(torch.float32).contiguous()  # low 32 bits of each pattern
        for n in (x.numel(), 1, 7, 17):  # torch's tail and our scalar loop too
            part = x[-n:].contiguous()
            got = torch.empty(n, dtype=torch.bfloat16)
            lib.ac_to_bf16(part.data_ptr(), got.data_ptr(), n)
            ok = ok and torch.equal(got.view(torch.int16), part.to(torch.bfloat16).view(torch.int16))
        _bf16_agrees = ok
    return _bf16_agrees


def to_bf16(x: Tensor, out: Tensor) -> bool:
    """``out.copy_(x)`` from float32 to bfloat16, bitwise torch's rounding, in one vectorised pass
    (torch's conversion took ~1.2 ns per element on the 2-core EPYC, 3x a read-write pass); False
    where torch must run."""
    if not (usable(x) and out.dtype == torch.bfloat16 and out.device.type == "cpu" and out.is_contiguous()
            and out.numel() == x.numel() and _bf16_checked()):
        return False
    library().ac_to_bf16(x.data_ptr(), out.data_ptr(), x.numel())  # type: ignore[union-attr]
    return True


def from_bf16(x: Tensor, out: Tensor) -> bool:
    """``out.copy_(x)`` from bfloat16 to float32 (exact: the 16 bits shifted up); False where torch
    must run."""
    if not (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous() and usable(out)
            and out.numel() == x.numel()):
        return False
    library().ac_from_bf16(x.data_ptr(), out.data_ptr(), x.numel())  # type: ignore[union-attr]
    return True


PACK_BITS = (1, 2, 4)


def _bytes_ok(t: Tensor) -> bool:
    return t.is_cpu and t.dtype in (torch.uint8, torch.bool) and t.is_contiguous()


def pack(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor | None:
    """:func:`adacomp.compressors._bitpack.pack_bits` of 1-D uint8 / bool ``codes`` (values below
    ``2**bits``, ``bits`` in 1, 2, 4) in one pass, into ``out`` (contiguous uint8 of the packed size)
    when given; None where the torch path must answer."""
    lib = library()
    if lib is None or bits not in PACK_BITS or not _bytes_ok(codes):
        return None
    n = codes.numel()
    if out is None:
        out = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
    elif not (_bytes_ok(out) and out.numel() == -(-n * bits // 8)):
        return None
    lib.ac_pack(codes.data_ptr(), n, bits, out.data_ptr())
    return out


def unpack(packed: Tensor, bits: int, numel: int) -> Tensor | None:
    """The first ``numel`` codes of ``packed`` as uint8 (``bits`` in 1, 2, 4), or None."""
    lib = library()
    if lib is None or bits not in PACK_BITS or not _bytes_ok(packed) or packed.numel() * 8 < numel * bits:
        return None
    out = torch.empty(numel, dtype=torch.uint8)
    lib.ac_unpack(packed.data_ptr(), numel, bits, out.data_ptr())
    return out


def pack_nonneg(x: Tensor) -> Tensor | None:
    """``pack_bits(x >= 0, 1)`` of a 1-D float32 tensor in one read, or None."""
    if not usable(x):
        return None
    out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    library().ac_pack_nonneg(x.data_ptr(), x.numel(), out.data_ptr())  # type: ignore[union-attr]
    return out


def decode(packed: Tensor, bits: int, numel: int, values: Tensor, out: Tensor) -> bool:
    """``out[i] = values[code i]`` for the first ``numel`` codes (float32 ``values`` of
    ``2**bits`` entries, contiguous float32 ``out``); False where the torch path must answer."""
    lib = library()
    if (lib is None or bits not in PACK_BITS or not _bytes_ok(packed) or packed.numel() * 8 < numel * bits
            or not usable(out) or out.numel() < numel or values.numel() != 1 << bits):
        return False
    vals = values.to(device="cpu", dtype=torch.float32).contiguous()
    lib.ac_decode(packed.data_ptr(), numel, bits, vals.data_ptr(), out.data_ptr())
    return True


def select_rows(a: Tensor, thr: Tensor, mode: str, expected: float = 1.0,
                limit: int | None = None) -> tuple[Tensor, Tensor, int] | None:
    """:func:`select` on an (m, n) contiguous float32 ``a`` with the float32 threshold ``thr[row]``
    per row (``mode`` "ge" or "not_lt"; "abs_ge" / "abs_not_lt" compare |a| and return |a|): ascending
    flat indices, their values, and the count. When more than ``limit`` pass (a set the caller
    rejects), the indices and values are left empty and only the count is right. None where the
    torch path must answer."""
    lib = library()
    if (lib is None or a.dim() != 2 or not usable(a) or thr.dtype != torch.float32 or thr.device.type != "cpu"
            or thr.numel() != a.shape[0] or mode not in ("ge", "not_lt", "abs_ge", "abs_not_lt")):
        return None
    m, n = a.shape
    t = thr.contiguous()
    cap = min(m * n, int(m * n * min(1.0, expected) * 1.5) + 1024)
    f = getattr(lib, f"ac_select_rows_{mode}")
    while True:
        idx = torch.empty(cap, dtype=torch.int64)
        vals = torch.empty(cap, dtype=torch.float32)
        c = int(f(a.data_ptr(), m, n, t.data_ptr(), idx.data_ptr(), vals.data_ptr(), cap))
        if c <= cap:
            if cap > 2 * c + 4096:
                return idx[:c].clone(), vals[:c].clone(), c
            return idx[:c], vals[:c], c
        if limit is not None and c > limit:
            return idx[:0], vals[:0], c
        cap = c


def momentum_accumulate(u: Tensor, g: Tensor, v: Tensor, u_out: Tensor, v_out: Tensor, momentum: float) -> bool:
    """``u_out = u * momentum + g`` (two roundings, as ``mul`` then ``add_``) and ``v_out = v + u_out``
    in one pass (DGC's momentum correction, bitwise torch's floats); False where torch must run."""
    ts = (u, g, v, u_out, v_out)
    if not all(usable(t) for t in ts) or len({t.numel() for t in ts}) != 1:
        return False
    if len({t.data_ptr() for t in ts}) != 5:  # outputs may not alias inputs
        return False
    library().ac_momentum_accumulate(u.data_ptr(), g.data_ptr(), v.data_ptr(), u_out.data_ptr(),  # type: ignore[union-attr]
                                     v_out.data_ptr(), u.numel(), momentum)
    return True


def momentum_select(u: Tensor, g: Tensor, v: Tensor, u_out: Tensor, v_out: Tensor, momentum: float, thr: float,
                    expected: float = 1.0, zeroed: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """:func:`momentum_accumulate` (the same floats) and, from the same pass, what :func:`select` in
    mode ``abs_ge`` finds over ``v_out``: ascending positions of ``|v_out| >= thr`` with the signed
    values there (DGC's candidates; select would give magnitudes). ``zeroed``: positions (checked
    by :func:`ascending_within`) where ``u`` and ``v`` are read as +0.0, as if zeroed first (DGC's
    masking left to this pass). None (nothing written) where torch must run."""
    ts = (u, g, v, u_out, v_out)
    if not all(usable(t) for t in ts) or len({t.numel() for t in ts}) != 1 or len({t.data_ptr() for t in ts}) != 5:
        return None
    lib = library()
    assert lib is not None
    ptrs, n = [t.data_ptr() for t in ts], u.numel()
    if zeroed is not None and not (_cpu_contiguous(zeroed, torch.int64) and zeroed.dim() == 1):
        return None
    zp, zm = (zeroed.data_ptr(), zeroed.numel()) if zeroed is not None else (None, 0)
    return _compacted(lambda i, vv, cap: lib.ac_momentum_select_abs_ge(*ptrs, n, momentum, thr, i, vv, cap, zp, zm),
                      n, expected)


def ascending_within(idx: Tensor, n: int) -> bool:
    """Whether the int64 positions ``idx`` (1-D) are strictly ascending and within ``[0, n)`` (what
    :func:`momentum_select` needs of ``zeroed``); False where the C library does not serve."""
    lib = library()
    if lib is None or not _cpu_contiguous(idx, torch.int64) or idx.dim() != 1:
        return False
    return bool(lib.ac_ascending_within(idx.data_ptr(), idx.numel(), n))


def sorted_member(a: Tensor, b: Tensor) -> Tensor | None:
    """``torch.isin(a, b)`` for ascending int64 ``a`` and ``b`` (1-D), by one merge; None where the C
    library does not serve (or either is not ascending, checked: a wrong order would answer wrongly)."""
    lib = library()
    if (lib is None or not (_cpu_contiguous(a, torch.int64) and _cpu_contiguous(b, torch.int64))
            or a.dim() != 1 or b.dim() != 1 or not (_ascending(lib, a) and _ascending(lib, b))):
        return None
    kept = torch.empty(a.numel(), dtype=torch.bool)
    lib.ac_sorted_member(a.data_ptr(), a.numel(), b.data_ptr(), b.numel(), kept.data_ptr())
    return kept


def merge_sum(idx: list[Tensor], vals: list[Tensor]) -> tuple[Tensor, Tensor] | None:
    """Ascending distinct positions of the runs ``idx`` (each strictly ascending int64, checked) and
    the sum of the float32 ``vals`` at each, in run order from +0.0: bitwise ``torch.unique`` of the
    concatenation and ``index_add_`` into zeros, by one merge. None where the C library does not serve."""
    lib = library()
    arrays = _sparse_arrays(idx, vals)
    if lib is None or arrays is None or not all(_ascending(lib, i) for i in idx):
        return None
    iptr, vptr, counts, pos = arrays
    total = sum(i.numel() for i in idx)
    out_idx = torch.empty(total, dtype=torch.int64)
    out_vals = torch.empty(total, dtype=torch.float32)
    c = int(lib.ac_merge_sum(len(idx), iptr, vptr, counts, pos, out_idx.data_ptr(), out_vals.data_ptr()))
    return out_idx[:c], out_vals[:c]


def _ascending(lib: ctypes.CDLL, idx: Tensor) -> bool:
    """Whether int64 ``idx`` is strictly ascending and non-negative."""
    return not idx.numel() or bool(lib.ac_ascending_within(idx.data_ptr(), idx.numel(), 2 ** 62))


_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState) on 64-bit targets (the layout ac_mt_uniform reads)
_rng_agrees: bool | None = None


def _rng_checked() -> bool:
    """Whether ac_mt_uniform reproduces this torch's ``uniform_`` (numbers and generator state,
    across twists): checked once per process, so a torch whose generator differs keeps its own."""
    global _rng_agrees
    lib = library()
    if lib is None:  # not cached: ADACOMP_NATIVE=0 may be a passing switch
        return False
    if _rng_agrees is None:
        ok = True
        mine, theirs = torch.Generator().manual_seed(20261126), torch.Generator().manual_seed(20261126)
        for n in (1, 623, 700, 1900, 5):
            st = mine.get_state()
            got = torch.empty(n)
            ok = st.numel() == _STATE_BYTES and lib.ac_mt_uniform(st.data_ptr(), got.data_ptr(), n) == 0
            if not ok:
                break
            mine.set_state(st)
            want = torch.empty(n).uniform_(generator=theirs)
            ok = torch.equal(got, want) and torch.equal(mine.get_state(), theirs.get_state())
            if not ok:
                break
        _rng_agrees = ok
    return _rng_agrees


_randint_agrees: bool | None = None


def _randint_checked() -> bool:
    """Whether ac_mt_sample_take draws this torch's ``randint`` positions (and leaves the generator in
    its state), on ranges from 1 to 2^24 across twists: checked once per process."""
    global _randint_agrees
    if not _rng_checked():
        return False
    if _randint_agrees is None:
        ok = True
        mine, theirs = torch.Generator().manual_seed(20261130), torch.Generator().manual_seed(20261130)
        for n, m in ((1, 3), (7, 623), (1000, 700), ((1 << 24) - 3, 1900), (5, 5)):
            a = torch.arange(n, dtype=torch.float32)  # exact up to 2^24: the values are the positions
            got = sample_take(a, m, mine, checked=True)
            want = torch.randint(n, (m,), generator=theirs).to(torch.float32)
            ok = got is not None and torch.equal(got, want) and torch.equal(mine.get_state(), theirs.get_state())
            if not ok:
                break
        _randint_agrees = ok
    return _randint_agrees


def sample_take(a: Tensor, m: int, gen: torch.Generator, checked: bool = False) -> Tensor | None:
    """``a[torch.randint(a.numel(), (m,), generator=gen)]`` for 1-D ``a`` in one C call: the same
    values in the same order and ``gen`` left in the same state, no position tensor. None (nothing
    drawn) where torch must run."""
    n = a.numel()
    if not (usable(a) and a.dim() == 1 and 1 <= n < 1 << 32 and m >= 0 and gen.device.type == "cpu"
            and (checked or _randint_checked())):
        return None
    st, out = gen.get_state(), torch.empty(m, dtype=torch.float32)
    if library().ac_mt_sample_take(st.data_ptr(), a.data_ptr(), n, m, out.data_ptr()) != 0:  # type: ignore[union-attr]
        return None
    gen.set_state(st)
    return out


class SIDCoChoice(NamedTuple):
    """What :func:`sidco_choose` found: the payload's positions and signed values, the final
    threshold, per later stage its shifted mean, how many passed its threshold and how many it kept
    (the chain's hints for the next step), and how many passes read the whole tensor (the last try's)."""
    idx: Tensor
    vals: Tensor
    thr: float
    stages: list[tuple[float, int, int]]
    reads: int


def sidco_choose(a: Tensor, cands: tuple[float, Tensor, Tensor] | None, thr: float, lr: float,
                 margins: list[float], expects: list[int], shares: list[float], out_share: float) -> SIDCoChoice | None:
    """SIDCo-E's choice over 1-D ``a`` in one C call (``ac_sidco_choose``): what
    :meth:`~adacomp.compressors.sidco.SIDCoCompressor.choose` finds through one
    :meth:`~adacomp.compressors.sparse.ThresholdCounter.shifted_mean_keep` per later stage
    (:func:`tail_sum_keep`, :func:`mean_from_sum`) and the counter's pick. ``thr``: the first fit's
    threshold; ``lr``: log of the per-stage ratio; per later stage the floor's distance above its
    threshold (``margins``), the count expected to pass it (``expects``, the sum's levels) and the
    share of ``a`` expected to pass the floor (``shares``). ``cands``: error feedback's ``(floor,
    positions, signed values)``. ``shares`` / ``out_share`` (the payload's) size the buffers first
    (the chain's guesses; a short one costs a second call, never another answer). None where the
    chain must answer: why one call, ~50 Python calls and 4 torch ops a tensor fewer (ResNet-50: 76 a step)."""
    n, later = a.numel(), len(margins)
    if not (usable(a) and a.dim() == 1 and 1 <= n < 1 << 31 and len(expects) == len(shares) == later
            and sums_like_torch()):
        return None
    mean_from_sum(1.0, 3)  # torch's division checked once (the C divides as it does where they agree)
    if not _div_agrees[0]:
        return None
    cfloor, cp, vp, nc = 0.0, None, None, -1
    if cands is not None:
        cfloor, cidx, cvals = cands
        if not (_cpu_contiguous(cidx, torch.int64) and usable(cvals) and cidx.numel() == cvals.numel() >= 1):
            return None  # (none kept: the chain's counts over an empty set)
        cp, vp, nc = cidx.data_ptr(), cvals.data_ptr(), cvals.numel()
    lib = library()
    assert lib is not None
    info = (ctypes.c_double * (5 + 3 * later))()
    dm, de = (ctypes.c_double * max(1, later))(*margins), (ctypes.c_int64 * max(1, later))(*expects)
    # the even stages write k0, the odd ones k1 (each reads the other's); sized as the chain's first guesses
    caps = [max((_first_room(n, x) for x in shares[p::2]), default=0) for p in (0, 1)] + [_first_room(n, out_share)]
    for _ in range(later + 2):  # again with room for a set that outgrew its first guess
        k0i, k0v = _compaction_buffers(caps[0], torch.int32) if caps[0] else (a, a)
        k1i, k1v = _compaction_buffers(caps[1], torch.int32) if caps[1] else (a, a)
        oi, ov = _compaction_buffers(caps[2])
        c = int(lib.ac_sidco_choose(a.data_ptr(), n, vp, cp, nc, cfloor, thr, lr, later, ctypes.addressof(dm),
                                    ctypes.addressof(de), k0i.data_ptr(), k0v.data_ptr(), caps[0], k1i.data_ptr(),
                                    k1v.data_ptr(), caps[1], oi.data_ptr(), ov.data_ptr(), caps[2],
                                    ctypes.addressof(info)))
        if c != -2:
            break
        caps = [max(cap, int(info[1 + q])) for q, cap in enumerate(caps)]
    if c < 0:
        return None
    idx, vals = _trimmed(oi, ov, c, caps[2])
    return SIDCoChoice(idx, vals, info[0], [(info[5 + 3 * s], int(info[6 + 3 * s]), int(info[7 + 3 * s]))
                                            for s in range(later)], int(info[4]))


def dgc_choose(a: Tensor, gen: torch.Generator | None, m: int, ks: int,
               cands: tuple[float, Tensor, Tensor] | None, k: int, lower: float, upper: float,
               iters: int) -> tuple[Tensor, Tensor] | None:
    """DGC's choice over 1-D ``a`` in one C call (``ac_dgc_choose``): the positions (ascending, or
    the k largest) and signed values :meth:`~adacomp.compressors.dgc.DGCCompressor.choose` finds
    through :func:`sample_take`, :func:`rth_largest_strided`, the counter's picks and
    :func:`pick_largest`, with ``gen`` left where they leave it. ``gen``: the sample's generator (m
    of a's values drawn), None where the sample is ``a`` itself (``m == a.numel()``). ``cands``:
    the momentum pass's ``(floor, positions, signed values)``. None (``gen`` untouched) where that
    chain must run: why one call, ~60 Python calls and ~10 torch ops a tensor (ResNet-50: 76 a step)."""
    n = a.numel()
    if not (usable(a) and a.dim() == 1 and 1 <= ks <= m <= n and 1 <= k < n):
        return None
    if gen is not None:
        if not (m < n < 1 << 32 and gen.device.type == "cpu" and _randint_checked()):
            return None
    elif m != n:
        return None
    floor, cp, vp, nc = 0.0, None, None, 0
    if cands is not None:
        floor, cidx, cvals = cands
        if not (_cpu_contiguous(cidx, torch.int64) and usable(cvals) and cidx.numel() == cvals.numel()):
            return None
        cp, vp, nc = cidx.data_ptr(), cvals.data_ptr(), cvals.numel()
    lib = library()
    assert lib is not None
    # the chain's first guess of the picks' size (1.5 times the k it expects), in the pool its picks
    # use: the payload is views of them where they fill it (no copy), as the chain's
    cap = min(n, int(1.5 * k) + 1024)
    st = gen.get_state() if gen is not None else None
    sample = _reused("sample", m, torch.float32).data_ptr() if gen is not None else None
    drawn = False
    for _ in range(2):  # again with room for the count where a threshold passed more (the sample kept)
        idx, vals = _compaction_buffers(cap)
        c = lib.ac_dgc_choose(a.data_ptr(), n, None if st is None or drawn else st.data_ptr(), m, ks, vp, cp, nc,
                              floor, k, lower, iters, sample, _keys(m).data_ptr(), idx.data_ptr(), vals.data_ptr(),
                              cap)
        if c > -2:
            break
        drawn, cap = True, -2 - c
    if c < 0:
        return None
    if c > upper * k:  # the second, exact top-k among them (the pool's buffers are free again after it)
        got = pick_largest(vals[:c], idx[:c], k, None)
        if got is None:
            return None
    else:
        got = _trimmed(idx, vals, c, cap)
    if gen is not None and st is not None:
        gen.set_state(st)
    return got


def uniform_(out: Tensor, gen: torch.Generator) -> bool:
    """``out.uniform_(generator=gen)`` bitwise (the same numbers, the generator left in the same
    state), ~3x faster than torch's serial loop; False where torch must run (then nothing was
    drawn). QSGD's stochastic rounding spent ~40 % of its step in ``uniform_`` (issue 32)."""
    if not (usable(out) and gen.device.type == "cpu" and _rng_checked()):
        return False
    st = gen.get_state()
    if library().ac_mt_uniform(st.data_ptr(), out.data_ptr(), out.numel()) != 0:  # type: ignore[union-attr]
        return False
    gen.set_state(st)
    return True


def uniform_discard(gen: torch.Generator, n: int, scratch: Tensor) -> bool:
    """Draw ``n`` numbers of ``gen``'s ``uniform_`` stream into ``scratch`` a chunk at a time, each
    chunk over the last, in C calls on one copy of the state (no state round trip per chunk): what
    the numbers cost without storing them all (the cost benchmark's ``rng`` pass). ``gen`` is left
    as it was. False where the C generator cannot stand in for torch's."""
    if not (usable(scratch) and gen.device.type == "cpu" and _rng_checked() and scratch.numel() > 0):
        return False
    st, lib, ptr, chunk = gen.get_state(), library(), scratch.data_ptr(), scratch.numel()
    for lo in range(0, n, chunk):
        if lib.ac_mt_uniform(st.data_ptr(), ptr, min(chunk, n - lo)) != 0:  # type: ignore[union-attr]
            return False
    return True


def ctr_uniform_(out: Tensor, key: tuple[int, int], start: int) -> bool:
    """Fill 1-D float32 ``out`` with the counter stream's numbers of positions ``start, start + 1,
    ...`` under ``key`` (``ac_ctr_uniform``; ``_counter_rng.uniform_`` is its torch twin); False
    (nothing written) where the library cannot serve ``out``."""
    if not usable(out) or out.dim() != 1 or start < 0:
        return False
    return library().ac_ctr_uniform(key[0], key[1], start, out.data_ptr(), out.numel()) == 0  # type: ignore[union-attr]


def qsgd_compress(x: Tensor, padded: int, safe: Tensor, size: int, s: int, bits: int, gen: torch.Generator | None,
                  out: Tensor, norms: Tensor | None = None, key: tuple[int, int] | None = None) -> bool:
    """QSGD's codes of the whole 1-D float32 ``x`` packed into ``out`` in one C loop over L1-sized
    tiles (each tile's uniforms drawn from ``gen``, ``padded`` in all, then coded and packed), bitwise
    ``qsgd.py``'s block loop and leaving ``gen`` in its state; False (``gen`` untouched) where that
    loop must run: a NaN code, another layout, or bits outside 2, 4, 8. With ``norms``, the bucket
    norms are computed in the same loop into ``norms`` (bitwise torch's, see :func:`norm_lanes`) and
    ``safe`` is written, not read; False too where this torch's norm order is not known. With ``key``
    (QSGD's ``rng: counter``) the uniforms are the counter stream's and ``gen`` is not used."""
    lanes = 0
    if norms is not None:
        lanes = norm_lanes()
        if not (lanes and size % lanes == 0 and usable(norms) and norms.numel() == safe.numel()):
            return False
    if not (bits in (2, 4, 8) and usable(x) and usable(safe) and _bytes_ok(out)
            and out.numel() == -(-x.numel() * bits // 8) and safe.numel() * size >= padded >= x.numel()):
        return False
    words = None
    if key is not None:
        words = (ctypes.c_uint32 * 2)(*key)
        st = None
    elif gen is not None and gen.device.type == "cpu" and _rng_checked():
        st = gen.get_state()
    else:
        return False
    if library().ac_qsgd_compress(x.data_ptr(), x.numel(), padded, safe.data_ptr(), size,  # type: ignore[union-attr]
                                  float(s), bits, None if st is None else st.data_ptr(), words, out.data_ptr(),
                                  None if norms is None else norms.data_ptr(), lanes) != 0:
        return False
    if st is not None:
        gen.set_state(st)  # type: ignore[union-attr]
    return True


_lanes: int | None = None


def norm_lanes() -> int:
    """The accumulator count (8 or 16) with which ``ac_bucket_norms`` equals this torch's
    ``x.view(-1, size).norm(dim=1)`` bitwise (its vectorised last-dimension loop: one accumulator per
    vector lane, AVX2's 8 or AVX-512's 16), or 0 where neither does; checked once per process on
    probes of several scales, sizes and a partial last bucket. Why: QSGD's separate norm pass was
    a whole extra read of the gradient (~15 % of its step on GPT-2-small, issue 32)."""
    global _lanes
    lib = library()
    if lib is None:  # not cached: ADACOMP_NATIVE=0 may be a passing switch
        return 0
    if _lanes is None:
        _lanes = 0
        g = torch.Generator().manual_seed(20261127)
        probes = [(torch.randn(37 * size + size // 2, generator=g) * scale, size)
                  for size in (16, 512, 4096) for scale in (1.0, 1e-19, 1e17)]
        for lanes in (8, 16):
            if all(_bucket_norms_agree(lib, x, size, lanes) for x, size in probes):
                _lanes = lanes
                break
    return _lanes


def _bucket_norms_agree(lib: ctypes.CDLL, x: Tensor, size: int, lanes: int) -> bool:
    nb = -(-x.numel() // size)
    padded = torch.zeros(nb * size)
    padded[:x.numel()] = x
    got = torch.empty(nb)
    return (lib.ac_bucket_norms(x.data_ptr(), x.numel(), size, lanes, got.data_ptr()) == 0
            and torch.equal(got, padded.view(nb, size).norm(dim=1)))


def qsgd_codes(x: Tensor, rnd: Tensor, safe: Tensor, off0: int, size: int, s: int, codes: Tensor) -> bool:
    """QSGD's codes of block ``x`` in one pass (``adacomp.compressors.qsgd``: ``s + sign(v) *
    min(floor(s |v| / norm + u), s)``), bitwise torch's sequence of elementwise operations; False
    where torch must run (not float32 CPU tensors, or a NaN in the block)."""
    m = x.numel()
    if not (usable(x) and usable(rnd) and usable(safe) and rnd.numel() >= m and codes.dtype == torch.uint8
            and codes.is_contiguous() and codes.device.type == "cpu" and codes.numel() >= m):
        return False
    return library().ac_qsgd_codes(x.data_ptr(), m, rnd.data_ptr(), safe.data_ptr(), off0,  # type: ignore[union-attr]
                                   size, float(s), codes.data_ptr()) == 0


def table_mean(packed: list[Tensor], tables: list[Tensor], bits: int, size: int, numel: int, out: Tensor) -> bool:
    """The mean over ranks of codes decoded through per-rank, per-bucket tables (``tables[r]``:
    float32 (buckets, 2^bits), the value of each code), summed in rank order and divided by the
    world size, into ``out`` in one pass; False where torch must run."""
    lib = library()
    nb = -(-numel // size)
    if (lib is None or bits not in PACK_BITS or not usable(out) or out.numel() < numel or len(packed) < 2
            or len(tables) != len(packed) or not all(_bytes_ok(p) and p.numel() * 8 >= numel * bits for p in packed)
            or not all(usable(t) and t.numel() == nb << bits for t in tables)):
        return False
    ptrs = torch.tensor([p.data_ptr() for p in packed], dtype=torch.int64)
    tptrs = torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64)
    lib.ac_table_mean(ptrs.data_ptr(), tptrs.data_ptr(), len(packed), numel, bits, size, out.data_ptr())
    return True
