/* The same-host ceiling of one READ: process_vm_readv of one block from a child process, alone
 * and with the 8-byte word pdlink's cma path reads after the data in the same call (the peer's
 * registry generation); and the same through a /proc/<pid>/mem descriptor (pread of the block,
 * then of the word), which pdlink uses where a pid number cannot be trusted (docs/security.md).
 * No library, no checks: what the kernel charges per call.
 * Usage: cma_ceiling block_bytes calls  -> one JSON line {"block_us": .., "block_and_word_us": ..,
 *        "proc_mem_block_us": .., "proc_mem_block_and_word_us": ..}
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s block_bytes calls\n", argv[0]);
    return 2;
  }
  const size_t block = (size_t)atol(argv[1]);
  const int calls = atoi(argv[2]);
  char* remote = aligned_alloc(4096, block * 4 + 4096);
  uint64_t* word = aligned_alloc(4096, 4096);
  char* local = aligned_alloc(4096, block);
  double* lat = malloc(sizeof(double) * (size_t)calls);
  if (!remote || !word || !local || !lat || calls <= 0) return 1;
  memset(remote, 1, block * 4 + 4096);
  word[0] = 1;
  int p[2];
  if (pipe(p) != 0) return 1;
  pid_t child = fork();
  if (child == 0) { /* the same addresses after fork: the child only holds them */
    char x;
    if (read(p[0], &x, 1) < 0) _exit(1);
    _exit(0);
  }
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/mem", (int)child);
  int mem = open(path, O_RDWR | O_CLOEXEC);
  if (mem < 0) {
    perror(path);
    return 1;
  }
  double med[4];
  for (int mode = 0; mode < 4; ++mode) {
    uint64_t g = 0;
    for (int i = -calls / 10; i < calls; ++i) {
      struct iovec lv[2] = {{local, block}, {&g, 8}}, rv[2] = {{remote + 4096, block}, {word, 8}};
      double t0 = now_us();
      if (mode < 2 && process_vm_readv(child, lv, 1 + mode, rv, 1 + mode, 0) < 0) {
        perror("process_vm_readv");
        return 1;
      }
      if (mode >= 2 && (pread(mem, local, block, (off_t)(uintptr_t)(remote + 4096)) != (ssize_t)block ||
                        (mode == 3 && pread(mem, &g, 8, (off_t)(uintptr_t)word) != 8))) {
        perror("pread /proc/<pid>/mem");
        return 1;
      }
      if (i >= 0) lat[i] = now_us() - t0;
    }
    qsort(lat, (size_t)calls, sizeof(double), cmp);
    med[mode] = lat[calls / 2];
  }
  if (write(p[1], "x", 1) < 0) return 1;
  waitpid(child, NULL, 0);
  printf(
      "{\"block_us\": %.3f, \"block_and_word_us\": %.3f, \"proc_mem_block_us\": %.3f, "
      "\"proc_mem_block_and_word_us\": %.3f}\n",
      med[0], med[1], med[2], med[3]);
  return 0;
}
