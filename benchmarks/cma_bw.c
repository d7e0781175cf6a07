/* process_vm_readv against memcpy on this machine: what bounds gpurt's single copies.
 *
 *   cc -O2 -o /tmp/cma_bw benchmarks/cma_bw.c && /tmp/cma_bw 64 256
 *
 * A forked child holds S MiB (its pages shared with the parent's copy-on-write, so the
 * same physical memory); the parent reads it with process_vm_readv and with memcpy,
 * C KiB at a time into one scratch buffer (as the compiled shares feed a reduction), and
 * whole into an S MiB destination (as an allgather's copy).  HP=1 asks for transparent
 * huge pages.  Three rounds; GB/s counts the bytes read (scratch) or read + written. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *buffer(size_t n, int fill) {
    char *p = aligned_alloc(2 << 20, n);
    if (!p) { perror("aligned_alloc"); exit(1); }
    if (getenv("HP")) madvise(p, n, MADV_HUGEPAGE);
    memset(p, fill, n);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s S_MiB CHUNK_KiB\n", argv[0]); return 2; }
    size_t S = (size_t)atol(argv[1]) << 20, C = (size_t)atol(argv[2]) << 10;
    if (!S || !C || S % C) { fprintf(stderr, "S must be a multiple of the chunk\n"); return 2; }
    char *src = buffer(S, 1);
    pid_t pid = fork();
    if (pid == 0) { pause(); return 0; }
    char *scr = buffer(C, 0), *dst = buffer(S, 0);
    int bad = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        for (size_t o = 0; o < S; o += C) {
            struct iovec l = {scr, C}, r = {src + o, C};
            if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)C) bad = 1;
        }
        double t1 = now();
        for (size_t o = 0; o < S; o += C) memcpy(scr, src + o, C);
        double t2 = now();
        memcpy(dst, src, S);
        double t3 = now();
        for (size_t o = 0; o < S; o += C) {
            struct iovec l = {dst + o, C}, r = {src + o, C};
            if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)C) bad = 1;
        }
        double t4 = now();
        printf("S=%zu MiB, %zu KiB pieces: into scratch: CMA %.2f, memcpy %.2f GB/s read; "
               "S to S: memcpy %.2f, CMA %.2f GB/s read+written\n", S >> 20, C >> 10,
               S / (t1 - t0) / 1e9, S / (t2 - t1) / 1e9, 2 * S / (t3 - t2) / 1e9,
               2 * S / (t4 - t3) / 1e9);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    if (bad) { fprintf(stderr, "process_vm_readv failed or was short\n"); return 1; }
    return 0;
}
