/* The loopback TCP ceiling for bench/bench_transfer.py, in C: what one process can pull from
 * another over 127.0.0.1 with nothing but send/recv, the way a pull moves bytes.
 *
 *   tcp_ceiling BYTES REPS STREAMS [block|spin]
 *
 * A reader (this process) and a server (a forked child) connect STREAMS sockets over loopback.
 * Each repetition is one "pull": the reader sends one request byte on every stream, the server
 * answers each with BYTES/STREAMS bytes (one thread per stream on both sides), and the reader
 * times from the first request until the last byte arrived. One warm-up repetition is not
 * reported. Prints one JSON object: the GB/s of every repetition, and the CPU seconds both
 * processes spent per GB moved (user + system, from getrusage).
 *
 * How the bytes are moved (the last argument):
 *   block  blocking send() and recv(): the textbook stream (the default);
 *   spin   what pdlink's sockets do: non-blocking sends that wait in poll() when the socket buffer is
 *          full, and receives that busy-poll (MSG_DONTWAIT) instead of sleeping, so the reader's
 *          CPU is awake when the next segment lands. pdlink spins 50 us before it sleeps; this spins
 *          throughout, the most one stream gets this way.
 *
 * Each process lands or sends from its own buffer, made after the fork and touched before timing, in
 * huge pages where the kernel gives them (numpy asks for them for its large arrays, which is where
 * pdlink's benchmark caches live).
 *
 * Built by bench_transfer.py with the system's C compiler (cc -O2 -pthread). Loopback only.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_STREAMS 64

static size_t g_share; /* bytes per stream per repetition */
static long g_reps;    /* repetitions, warm-up included */
static char* g_buf;    /* what the server sends / where the reader lands it */
static int g_spin;     /* the "spin" mode */

static void die(const char* what) {
  perror(what);
  exit(2);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_seconds(int who) {
  struct rusage ru;
  getrusage(who, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
         (double)ru.ru_stime.tv_usec * 1e-6;
}

static void send_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL | (g_spin ? MSG_DONTWAIT : 0));
    if (k < 0 && g_spin && errno == EAGAIN) {
      struct pollfd q = {.fd = fd, .events = POLLOUT};
      poll(&q, 1, -1);
      continue;
    }
    if (k <= 0) die("send");
    p += k;
    n -= (size_t)k;
  }
}

static void recv_all(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t k = recv(fd, p, n, g_spin ? MSG_DONTWAIT : 0);
    if (k < 0 && g_spin && errno == EAGAIN) continue;
    if (k <= 0) die("recv");
    p += k;
    n -= (size_t)k;
  }
}

struct stream {
  int fd;
  int index;
  pthread_barrier_t *start, *done;
};

/* Server side of one stream: answer each request byte with this stream's share. */
static void* serve(void* arg) {
  struct stream* s = arg;
  char req;
  for (long r = 0; r < g_reps; r++) {
    recv_all(s->fd, &req, 1);
    send_all(s->fd, g_buf + (size_t)s->index * g_share, g_share);
  }
  return NULL;
}

/* Reader side of one stream: per repetition, wait for the start, request, land the share. */
static void* land(void* arg) {
  struct stream* s = arg;
  const char req = 'r';
  for (long r = 0; r < g_reps; r++) {
    pthread_barrier_wait(s->start);
    send_all(s->fd, &req, 1);
    recv_all(s->fd, g_buf + (size_t)s->index * g_share, g_share);
    pthread_barrier_wait(s->done);
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    fprintf(stderr, "usage: %s BYTES REPS STREAMS [block|spin]\n", argv[0]);
    return 2;
  }
  const char* mode = argc == 5 ? argv[4] : "block";
  if (strcmp(mode, "block") != 0 && strcmp(mode, "spin") != 0) {
    fprintf(stderr, "the mode is block or spin, not %s\n", mode);
    return 2;
  }
  g_spin = strcmp(mode, "spin") == 0;
  size_t bytes = strtoull(argv[1], NULL, 10);
  long reps = strtol(argv[2], NULL, 10);
  int streams = atoi(argv[3]);
  if (bytes == 0 || reps < 1 || streams < 1 || streams > MAX_STREAMS || bytes % (size_t)streams) {
    fprintf(stderr, "BYTES > 0 divisible by STREAMS (1..%d), REPS >= 1\n", MAX_STREAMS);
    return 2;
  }
  g_share = bytes / (size_t)streams;
  g_reps = reps + 1;

  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof addr;
  if (lfd < 0 || bind(lfd, (struct sockaddr*)&addr, sizeof addr) || listen(lfd, streams) ||
      getsockname(lfd, (struct sockaddr*)&addr, &alen))
    die("listen");

  pid_t child = fork();
  if (child < 0) die("fork");
  /* each process its own buffer, made after the fork (no copy-on-write sharing), in huge pages
     where the kernel gives them (as numpy asks for its large arrays), touched before timing */
  g_buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (g_buf == MAP_FAILED) die("mmap");
  madvise(g_buf, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes; i++) g_buf[i] = (char)(i * 7);
  int one = 1;
  struct stream st[MAX_STREAMS];
  pthread_t th[MAX_STREAMS];
  if (child == 0) { /* the server */
    for (int i = 0; i < streams; i++) {
      int fd = accept(lfd, NULL, NULL);
      if (fd < 0) die("accept");
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      char index;
      recv_all(fd, &index, 1);
      st[i] = (struct stream){.fd = fd, .index = index};
    }
    for (int i = 0; i < streams; i++) pthread_create(&th[i], NULL, serve, &st[i]);
    for (int i = 0; i < streams; i++) pthread_join(th[i], NULL);
    _exit(0);
  }
  close(lfd);
  pthread_barrier_t start, done;
  pthread_barrier_init(&start, NULL, (unsigned)streams + 1);
  pthread_barrier_init(&done, NULL, (unsigned)streams + 1);
  for (int i = 0; i < streams; i++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr*)&addr, sizeof addr)) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char index = (char)i;
    send_all(fd, &index, 1);
    st[i] = (struct stream){.fd = fd, .index = i, .start = &start, .done = &done};
    pthread_create(&th[i], NULL, land, &st[i]);
  }
  double* gbps = calloc((size_t)g_reps, sizeof(double));
  double cpu0 = 0;
  for (long r = 0; r < g_reps; r++) {
    if (r == 1) cpu0 = cpu_seconds(RUSAGE_SELF);
    double t0 = now();
    pthread_barrier_wait(&start);
    pthread_barrier_wait(&done);
    gbps[r] = (double)bytes / (now() - t0) / 1e9;
  }
  double reader_cpu = cpu_seconds(RUSAGE_SELF) - cpu0;
  for (int i = 0; i < streams; i++) pthread_join(th[i], NULL);
  int status;
  if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "the server failed\n");
    return 1;
  }
  /* the server's CPU includes its warm-up repetition: scaled to the timed ones */
  double server_cpu = cpu_seconds(RUSAGE_CHILDREN) * (double)reps / (double)g_reps;
  printf("{\"streams\": %d, \"mode\": \"%s\", \"bytes\": %zu, \"gbps\": [", streams, mode, bytes);
  for (long r = 1; r < g_reps; r++) printf("%s%.4f", r > 1 ? ", " : "", gbps[r]);
  printf("], \"cpu_s_per_gb\": %.4f}\n", (reader_cpu + server_cpu) / ((double)bytes * (double)reps / 1e9));
  return 0;
}
