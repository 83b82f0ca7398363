/* pdlink-wire: the userspace wire of pdlink.testing.hosts (docs/hosts.md).
 *
 * Delay, jitter, loss (random and in bursts) and reordering for the links of emulated hosts, on a
 * kernel without netem. It runs in the switch's network namespace. Each relayed port I joins two
 * devices: the switch's end of host I's veth pair (read and written through an AF_PACKET socket)
 * and a TAP device on the bridge. Frames keep their GSO form both ways (PACKET_VNET_HDR, IFF_VNET_HDR
 * with TUNSETOFFLOAD): one read moves up to 64 KiB, so the relay is not the bottleneck.
 *
 * One thread, one epoll loop. Each direction of each port has a queue ordered by departure time
 * (a binary heap); a frame departs at arrival + delay + jitter (uniform in [-jitter, +jitter]),
 * never before the frame queued ahead of it (no reordering from jitter), except a `reorder`
 * fraction that departs at once, ahead of the queue. With a rate (UP_BPS, DOWN_BPS > 0) a direction
 * is a link that sends one frame after the other at that rate (the bytes of its packets on a wire:
 * payload and each segment's headers) before the delay starts; LIMIT_BYTES then bounds the backlog
 * waiting to be sent, like a switch port's buffer. Loss is a two-state (Gilbert) chain per
 * direction: `loss` of the packets are lost, in bursts of `burst` packets on average, decided per
 * segment of a GSO frame (a TCP/IPv4 GSO frame that loses some of its segments is cut into its
 * segments here, as the kernel would, and the survivors move; another kind of GSO frame is lost
 * whole when any of its segments is). A queue holds at
 * most `limit` bytes; a frame beyond that is dropped (drop-tail, like a switch's buffer). A write
 * that the kernel refuses (link down, a full qdisc) drops the frame.
 *
 * Control: one command a line on stdin, one answer a line on stdout ("ok ..." or "error ..."):
 *   add I HOSTDEV TAPNAME          relay port I between device HOSTDEV and a new TAP TAPNAME
 *   wire I DELAY_NS JITTER_NS LOSS BURST REORDER LIMIT_BYTES UP_BPS DOWN_BPS   port I
 *   del I                          stop relaying port I (the TAP goes away)
 *   stats I                        "ok up_in up_out up_lost up_dropped down_in ..." (frames read,
 *                                  frames written, segments lost, frames dropped)
 *   quit
 * End of stdin ends the program, and so does the death of the parent named on the command line
 * (PR_SET_PDEATHSIG). The relay runs at real-time priority 1 where it may (else nice -10).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_packet.h>
#include <linux/if_tun.h>
#include <linux/sockios.h>
#include <linux/virtio_net.h>
#include <net/ethernet.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

#define MAX_PORTS 256
#define INFLIGHT_MAX (32ull << 20) /* bytes in flight a direction without a rate may hold */
#define FRAME_MAX (65536 + 64)
#define BATCH 64
/* Closer than `ahead` to a departure, the loop polls instead of sleeping on the timer, and the timer
 * is set `ahead` before it: `ahead` follows how late this machine's timer wakes us (twice its
 * moving average, plus 5 us), between AHEAD_MIN_NS and AHEAD_MAX_NS. */
#define AHEAD_MIN_NS 5000
#define AHEAD_MAX_NS 200000

typedef struct frame {
  uint64_t due;
  uint64_t seq;
  uint32_t len;
  unsigned char data[];
} frame;

typedef struct {
  frame** heap;
  size_t n, cap;
  uint64_t bytes, last_due, seq;
  uint64_t free_at; /* with a rate: when the link has sent everything queued so far */
  int bad;          /* the Gilbert chain's state */
  uint64_t in, out, lost, dropped;
} queue;

typedef struct {
  uint64_t delay, jitter, limit, rate[2]; /* rate per direction: bits a second, 0: none */
  double loss, burst, reorder;
} params;

typedef struct {
  int used;
  int pkt; /* AF_PACKET on the host's veth end: frames from the host arrive here, frames to it leave */
  int tap; /* the TAP on the bridge */
  params p;
  queue q[2]; /* 0: up (host -> bridge), 1: down (bridge -> host) */
} port;

static port ports[MAX_PORTS];
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static double uniform(void) { /* xorshift64*, in [0, 1) */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

static int heap_less(const frame* a, const frame* b) {
  return a->due < b->due || (a->due == b->due && a->seq < b->seq);
}

static int heap_push(queue* q, frame* f) {
  if (q->n == q->cap) {
    size_t cap = q->cap ? q->cap * 2 : 256;
    frame** h = realloc(q->heap, cap * sizeof *h);
    if (!h) return -1;
    q->heap = h;
    q->cap = cap;
  }
  size_t i = q->n++;
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!heap_less(f, q->heap[parent])) break;
    q->heap[i] = q->heap[parent];
    i = parent;
  }
  q->heap[i] = f;
  q->bytes += f->len;
  return 0;
}

static frame* heap_pop(queue* q) {
  frame* top = q->heap[0];
  frame* last = q->heap[--q->n];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= q->n) break;
    if (c + 1 < q->n && heap_less(q->heap[c + 1], q->heap[c])) c++;
    if (!heap_less(q->heap[c], last)) break;
    q->heap[i] = q->heap[c];
    i = c;
  }
  if (q->n) q->heap[i] = last;
  q->bytes -= top->len;
  return top;
}

static void queue_clear(queue* q) {
  while (q->n) free(heap_pop(q));
  free(q->heap);
  memset(q, 0, sizeof *q);
}

static int lose(queue* q, const params* p) {
  if (p->loss <= 0) return 0;
  if (p->burst <= 1.0) return uniform() < p->loss;
  double to_bad = p->loss / (p->burst * (1.0 - p->loss)), to_good = 1.0 / p->burst;
  if (q->bad) {
    if (uniform() < to_good) q->bad = 0;
  } else if (uniform() < to_bad) {
    q->bad = 1;
  }
  return q->bad;
}

/* Queue one frame (loss already decided) for its departure: after the frames ahead of it are sent
 * (with a rate: `wire_bytes` at that rate) and the delay has passed. */
static void admit(port* pt, int dir, const unsigned char* buf, size_t len, uint64_t wire_bytes, uint64_t now) {
  queue* q = &pt->q[dir];
  const params* p = &pt->p;
  uint64_t sent_at = now, rate = p->rate[dir];
  if (rate) {
    uint64_t start = q->free_at > now ? q->free_at : now;
    uint64_t backlog = (uint64_t)((double)(start - now) * (double)rate / 8e9);
    if (backlog + wire_bytes > p->limit) { /* the buffer ahead of the link is full: drop-tail */
      q->dropped++;
      return;
    }
    q->free_at = start + (uint64_t)((double)wire_bytes * 8e9 / (double)rate);
    sent_at = q->free_at;
  } else if (q->bytes + len > (p->limit > INFLIGHT_MAX ? p->limit : INFLIGHT_MAX)) {
    q->dropped++; /* no rate: only frames in flight (the delay) are held; this bounds their memory */
    return;
  }
  frame* f = malloc(sizeof *f + len);
  if (!f) {
    q->dropped++;
    return;
  }
  memcpy(f->data, buf, len);
  f->len = (uint32_t)len;
  f->seq = q->seq++;
  if (p->reorder > 0 && uniform() < p->reorder) {
    f->due = sent_at; /* ahead of everything queued */
  } else {
    int64_t d = (int64_t)p->delay;
    if (p->jitter) d += (int64_t)((uniform() * 2.0 - 1.0) * (double)p->jitter);
    uint64_t due = sent_at + (uint64_t)(d > 0 ? d : 0);
    if (due < q->last_due) due = q->last_due;
    q->last_due = due;
    f->due = due;
  }
  if (heap_push(q, f) != 0) {
    free(f);
    q->dropped++;
  }
}

#define VNET_HDR sizeof(struct virtio_net_hdr)
#define ETH_HDR 14
#define MAX_SEGS 256

static uint16_t ip_checksum(const unsigned char* h, size_t n) {
  uint32_t sum = 0;
  for (size_t k = 0; k + 1 < n; k += 2) sum += (uint32_t)(h[k] << 8 | h[k + 1]);
  while (sum >> 16) sum = (sum & 0xFFFF) + (sum >> 16);
  return (uint16_t)~sum;
}

/* A GSO TCP/IPv4 frame: its header length (Ethernet, IP, TCP) and segment count; 0 when the frame is
 * not one (then it is lost or kept whole). */
static size_t tcp4_headers(const unsigned char* buf, size_t len, unsigned* segs) {
  const struct virtio_net_hdr* vh = (const void*)buf;
  if ((vh->gso_type & ~VIRTIO_NET_HDR_GSO_ECN) != VIRTIO_NET_HDR_GSO_TCPV4 || vh->gso_size == 0) return 0;
  if (len < VNET_HDR + ETH_HDR + 40) return 0;
  const unsigned char *eth = buf + VNET_HDR, *ip = eth + ETH_HDR;
  if (eth[12] != 0x08 || eth[13] != 0x00 || (ip[0] >> 4) != 4 || ip[9] != 6) return 0;
  size_t ihl = (size_t)(ip[0] & 0xF) * 4, doff = (size_t)(ip[ihl + 12] >> 4) * 4;
  size_t hdrs = ETH_HDR + ihl + doff;
  if (ihl < 20 || doff < 20 || VNET_HDR + hdrs >= len) return 0;
  size_t payload = len - VNET_HDR - hdrs;
  *segs = (unsigned)((payload + vh->gso_size - 1) / vh->gso_size);
  return *segs <= MAX_SEGS ? hdrs : 0;
}

/* Queue the segments of a GSO TCP/IPv4 frame that `lost` spares, each a frame of its own (what the
 * kernel's segmentation would have made: IP length, id and checksum, TCP sequence number and flags;
 * the TCP checksum left to the receiver's device, NEEDS_CSUM). */
static void admit_segments(port* pt, int dir, const unsigned char* buf, size_t len, size_t hdrs, unsigned segs,
                           const unsigned char* lost, uint64_t now) {
  static unsigned char out[FRAME_MAX];
  const struct virtio_net_hdr* vh = (const void*)buf;
  const unsigned char* ip = buf + VNET_HDR + ETH_HDR;
  size_t ihl = (size_t)(ip[0] & 0xF) * 4, payload = len - VNET_HDR - hdrs, mss = vh->gso_size;
  uint32_t seq0 = (uint32_t)ip[ihl + 4] << 24 | (uint32_t)ip[ihl + 5] << 16 | (uint32_t)ip[ihl + 6] << 8 | ip[ihl + 7];
  uint16_t id0 = (uint16_t)(ip[4] << 8 | ip[5]);
  for (unsigned j = 0; j < segs; j++) {
    if (lost[j]) continue;
    size_t off = (size_t)j * mss, plen = payload - off < mss ? payload - off : mss;
    struct virtio_net_hdr nvh;
    memset(&nvh, 0, sizeof nvh);
    nvh.flags = VIRTIO_NET_HDR_F_NEEDS_CSUM;
    nvh.gso_type = VIRTIO_NET_HDR_GSO_NONE;
    nvh.csum_start = (uint16_t)(ETH_HDR + ihl);
    nvh.csum_offset = 16;
    memcpy(out, &nvh, VNET_HDR);
    memcpy(out + VNET_HDR, buf + VNET_HDR, hdrs);
    memcpy(out + VNET_HDR + hdrs, buf + VNET_HDR + hdrs + off, plen);
    unsigned char *oip = out + VNET_HDR + ETH_HDR, *tcp = oip + ihl;
    size_t tot = hdrs - ETH_HDR + plen, tcp_len = tot - ihl;
    oip[2] = (unsigned char)(tot >> 8);
    oip[3] = (unsigned char)tot;
    uint16_t id = (uint16_t)(id0 + j);
    oip[4] = (unsigned char)(id >> 8);
    oip[5] = (unsigned char)id;
    oip[10] = oip[11] = 0;
    uint16_t ipsum = ip_checksum(oip, ihl);
    oip[10] = (unsigned char)(ipsum >> 8);
    oip[11] = (unsigned char)ipsum;
    uint32_t seq = seq0 + (uint32_t)off;
    tcp[4] = (unsigned char)(seq >> 24);
    tcp[5] = (unsigned char)(seq >> 16);
    tcp[6] = (unsigned char)(seq >> 8);
    tcp[7] = (unsigned char)seq;
    if (j + 1 < segs) tcp[13] &= (unsigned char)~0x09; /* FIN and PSH only on the last */
    if (j > 0) tcp[13] &= (unsigned char)~0x80;        /* CWR only on the first */
    uint32_t sum = 0; /* the pseudo-header's sum, not complemented: the receiver's device completes it */
    for (int k = 12; k < 20; k += 2) sum += (uint32_t)(oip[k] << 8 | oip[k + 1]);
    sum += 6 + (uint32_t)tcp_len;
    while (sum >> 16) sum = (sum & 0xFFFF) + (sum >> 16);
    tcp[16] = (unsigned char)(sum >> 8);
    tcp[17] = (unsigned char)sum;
    admit(pt, dir, out, VNET_HDR + hdrs + plen, hdrs + plen, now);
  }
}

/* A frame read from one side: the wire's loss is decided per segment (a GSO frame of k segments is
 * k packets on a real wire); a frame none of whose segments is lost moves whole. */
static void enqueue(port* pt, int dir, const unsigned char* buf, size_t len, uint64_t now) {
  queue* q = &pt->q[dir];
  const params* p = &pt->p;
  q->in++;
  if (len <= VNET_HDR) return;
  unsigned segs = 1;
  size_t hdrs = tcp4_headers(buf, len, &segs);
  if (!hdrs) segs = 1;
  /* what the frame's packets take on a wire: the payload and each segment's headers */
  uint64_t wire_bytes = (uint64_t)(len - VNET_HDR) + (uint64_t)(segs - 1) * hdrs;
  if (p->loss <= 0) {
    admit(pt, dir, buf, len, wire_bytes, now);
    return;
  }
  unsigned char lost[MAX_SEGS];
  unsigned nlost = 0;
  for (unsigned j = 0; j < segs; j++) nlost += lost[j] = (unsigned char)lose(q, p);
  q->lost += nlost;
  if (nlost == 0)
    admit(pt, dir, buf, len, wire_bytes, now);
  else if (nlost < segs)
    admit_segments(pt, dir, buf, len, hdrs, segs, lost, now);
}

static void flush(uint64_t now) {
  for (int i = 0; i < MAX_PORTS; i++) {
    port* pt = &ports[i];
    if (!pt->used) continue;
    for (int dir = 0; dir < 2; dir++) {
      queue* q = &pt->q[dir];
      int out = dir == 0 ? pt->tap : pt->pkt;
      while (q->n && q->heap[0]->due <= now) {
        frame* f = heap_pop(q);
        if (write(out, f->data, f->len) == (ssize_t)f->len)
          q->out++;
        else
          q->dropped++;
        free(f);
      }
    }
  }
}

static uint64_t next_due(void) {
  uint64_t next = UINT64_MAX;
  for (int i = 0; i < MAX_PORTS; i++) {
    if (!ports[i].used) continue;
    for (int dir = 0; dir < 2; dir++)
      if (ports[i].q[dir].n && ports[i].q[dir].heap[0]->due < next) next = ports[i].q[dir].heap[0]->due;
  }
  return next;
}

static int open_tap(const char* name) {
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -1;
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
  snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name);
  if (ioctl(fd, TUNSETIFF, &ifr) < 0 ||
      ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

static int open_packet(const char* dev) {
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) return -1;
  int one = 1, buf = 8 << 20;
  struct sockaddr_ll sll;
  memset(&sll, 0, sizeof sll);
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
  if (ioctl(fd, SIOCGIFINDEX, &ifr) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  sll.sll_ifindex = ifr.ifr_ifindex;
  if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0 ||
      setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0 ||
      bind(fd, (struct sockaddr*)&sll, sizeof sll) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof buf);
  return fd;
}

/* tag: the port index in the low bits, the side (0: packet socket, 1: TAP) in bit 16; -1: stdin,
 * -2: the timer. */
static int ep;

static void port_del(int i) {
  port* pt = &ports[i];
  if (!pt->used) return;
  epoll_ctl(ep, EPOLL_CTL_DEL, pt->pkt, NULL);
  epoll_ctl(ep, EPOLL_CTL_DEL, pt->tap, NULL);
  close(pt->pkt);
  close(pt->tap);
  queue_clear(&pt->q[0]);
  queue_clear(&pt->q[1]);
  memset(pt, 0, sizeof *pt);
}

static void answer(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void answer(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
  fflush(stdout);
}

static int command(char* line) {
  char op[16] = {0}, a[IFNAMSIZ + 1] = {0}, b[IFNAMSIZ + 1] = {0};
  int i = -1;
  if (sscanf(line, "%15s %d", op, &i) < 1) {
    answer("error empty command");
    return 0;
  }
  if (strcmp(op, "quit") == 0) return 1;
  if (i < 0 || i >= MAX_PORTS) {
    answer("error bad port in: %s", line);
    return 0;
  }
  port* pt = &ports[i];
  if (strcmp(op, "add") == 0) {
    if (sscanf(line, "%*s %*d %16s %16s", a, b) != 2) {
      answer("error usage: add I HOSTDEV TAPNAME");
      return 0;
    }
    port_del(i);
    int pkt = open_packet(a);
    if (pkt < 0) {
      answer("error packet socket on %s: %s", a, strerror(errno));
      return 0;
    }
    int tap = open_tap(b);
    if (tap < 0) {
      answer("error tap %s: %s", b, strerror(errno));
      close(pkt);
      return 0;
    }
    pt->used = 1;
    pt->pkt = pkt;
    pt->tap = tap;
    pt->p.limit = 32u << 20;
    pt->p.burst = 1.0;
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)i};
    epoll_ctl(ep, EPOLL_CTL_ADD, pkt, &ev);
    ev.data.u64 = (uint64_t)i | (1u << 16);
    epoll_ctl(ep, EPOLL_CTL_ADD, tap, &ev);
    answer("ok");
  } else if (strcmp(op, "wire") == 0) {
    unsigned long long delay, jitter, limit, up, down;
    double loss, burst, reorder;
    if (!pt->used || sscanf(line, "%*s %*d %llu %llu %lf %lf %lf %llu %llu %llu", &delay, &jitter, &loss, &burst,
                            &reorder, &limit, &up, &down) != 8) {
      answer("error usage: wire I DELAY_NS JITTER_NS LOSS BURST REORDER LIMIT_BYTES UP_BPS DOWN_BPS (port added)");
      return 0;
    }
    pt->p = (params){delay, jitter, limit, {up, down}, loss, burst < 1.0 ? 1.0 : burst, reorder};
    pt->q[0].free_at = pt->q[1].free_at = 0;
    answer("ok");
  } else if (strcmp(op, "del") == 0) {
    port_del(i);
    answer("ok");
  } else if (strcmp(op, "stats") == 0) {
    queue *u = &pt->q[0], *d = &pt->q[1];
    answer("ok %llu %llu %llu %llu %llu %llu %llu %llu", (unsigned long long)u->in, (unsigned long long)u->out,
           (unsigned long long)u->lost, (unsigned long long)u->dropped, (unsigned long long)d->in,
           (unsigned long long)d->out, (unsigned long long)d->lost, (unsigned long long)d->dropped);
  } else {
    answer("error unknown command: %s", op);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: pdlink-wire PARENT_PID (commands on stdin)\n");
    return 2;
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != (pid_t)atol(argv[1])) return 1;
  prctl(PR_SET_TIMERSLACK, 1UL);
  /* The wire is served before ordinary work: real-time priority 1 where it may (a frame's departure
   * is then late by the kernel's wake-up, not by the machine's load), else nice -10. Its work is
   * bounded by the traffic and it never spins longer than AHEAD_MAX_NS before a departure. */
  struct sched_param sp = {.sched_priority = 1};
  if (sched_setscheduler(0, SCHED_FIFO | SCHED_RESET_ON_FORK, &sp) != 0) setpriority(PRIO_PROCESS, 0, -10);
  signal(SIGPIPE, SIG_IGN);
  rng_state ^= now_ns() ^ ((uint64_t)getpid() << 32);
  ep = epoll_create1(EPOLL_CLOEXEC);
  int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
  struct epoll_event ev = {.events = EPOLLIN, .data.u64 = UINT64_MAX};
  epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev);
  ev.data.u64 = UINT64_MAX - 1;
  epoll_ctl(ep, EPOLL_CTL_ADD, timer, &ev);
  static unsigned char bufs[BATCH][FRAME_MAX];
  static struct iovec iovs[BATCH];
  static struct mmsghdr msgs[BATCH];
  for (int m = 0; m < BATCH; m++) {
    iovs[m].iov_base = bufs[m];
    iovs[m].iov_len = FRAME_MAX;
    msgs[m].msg_hdr.msg_iov = &iovs[m];
    msgs[m].msg_hdr.msg_iovlen = 1;
  }
  static char line[1024];
  size_t line_len = 0;
  uint64_t armed = 0, armed_for = 0, ahead = 20000, late_avg = 0;
  for (;;) {
    uint64_t now = now_ns();
    flush(now);
    uint64_t next = next_due();
    int timeout = -1;
    if (next != UINT64_MAX) {
      now = now_ns();
      if (next <= now + ahead) {
        timeout = 0;
      } else if (next != armed) {
        armed_for = next - ahead;
        struct itimerspec its = {{0, 0}, {(time_t)(armed_for / 1000000000ull), (long)(armed_for % 1000000000ull)}};
        timerfd_settime(timer, TFD_TIMER_ABSTIME, &its, NULL);
        armed = next;
      }
    }
    struct epoll_event evs[32];
    int n = epoll_wait(ep, evs, 32, timeout);
    if (n < 0 && errno != EINTR) return 1;
    now = now_ns();
    for (int k = 0; k < n; k++) {
      uint64_t tag = evs[k].data.u64;
      if (tag == UINT64_MAX - 1) {
        uint64_t expirations;
        if (read(timer, &expirations, sizeof expirations) < 0) { /* nothing to clear */
        }
        if (armed && now > armed_for) {
          late_avg = (late_avg * 7 + (now - armed_for)) / 8;
          ahead = 2 * late_avg + AHEAD_MIN_NS;
          if (ahead > AHEAD_MAX_NS) ahead = AHEAD_MAX_NS;
        }
        armed = 0;
      } else if (tag == UINT64_MAX) {
        for (;;) {
          ssize_t r = read(0, line + line_len, sizeof line - 1 - line_len);
          if (r == 0) return 0;
          if (r < 0) break;
          line_len += (size_t)r;
          char* nl;
          while ((nl = memchr(line, '\n', line_len)) != NULL) {
            *nl = 0;
            if (command(line)) return 0;
            size_t used = (size_t)(nl - line) + 1;
            memmove(line, nl + 1, line_len - used);
            line_len -= used;
          }
          if (line_len == sizeof line - 1) line_len = 0; /* an over-long line: dropped */
        }
      } else {
        int i = (int)(tag & 0xFFFF), side = (int)(tag >> 16);
        port* pt = &ports[i];
        if (!pt->used) continue;
        if (side) {
          for (int b = 0; b < BATCH; b++) {
            ssize_t r = read(pt->tap, bufs[0], FRAME_MAX);
            if (r < 0 && errno != EAGAIN && errno != EINTR) {
              /* the TAP is gone from under us (deleted): stop watching it, never spin on its error */
              epoll_ctl(ep, EPOLL_CTL_DEL, pt->tap, NULL);
              break;
            }
            if (r <= 0) break;
            enqueue(pt, 1, bufs[0], (size_t)r, now);
          }
        } else {
          int got = recvmmsg(pt->pkt, msgs, BATCH, MSG_DONTWAIT, NULL);
          for (int m = 0; m < got; m++) enqueue(pt, 0, bufs[m], msgs[m].msg_len, now);
        }
      }
    }
  }
}
