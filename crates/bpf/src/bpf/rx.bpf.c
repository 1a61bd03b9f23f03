// SPDX-License-Identifier: (Apache-2.0 OR GPL-2.0)
/*
 * bpf-gpu-server kernel transport, receive path (docs/bpf.md).
 *
 *   sock_ops  (cgroup2 root): passively established connections on the service port enter the
 *             sockhash (key: socket cookie) and get a reassembly state; TCP state changes
 *             publish EOF / RESET markers into the completion ring.
 *   sk_skb/verdict (sockhash): frames each connection's byte stream with exactly the rules of
 *             docs/protocol.md (crates/protocol/src/framer.rs) and publishes requests and
 *             rejections into the request ring of the shared region (an mmapable array map).
 *
 * Per-connection state is only touched while the kernel holds that socket's lock (the verdict
 * runs from tcp_data_ready / tcp_read_skb, sock_ops callbacks from the TCP state machine: both
 * under the socket lock), so it needs no atomics. The rings are multi-producer: claims use CAS,
 * publishes a fully ordered exchange of the slot's seq (docs/ring.md).
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "bgs_ring.h"
#include "bgs_protocol.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AF_INET 2
#define AF_INET6 10

#define barrier() asm volatile("" ::: "memory")
#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))
#define WRITE_ONCE(x, v) (*(volatile typeof(x) *)&(x) = (v))

#define SLOT_BYTES (BGS_RING_SLOT_WORDS * 4u)
/* Bounded retries of a ring claim's CAS loop (the verifier needs a bound). A claim fails this
 * many times only if as many other producers claimed in between; it then counts as full. */
#define CLAIM_TRIES 64

/* ---- configuration (rodata, set by the loader before load; the verifier sees constants) ---- */
const volatile __u32 cfg_port = 0;          /* service port, host byte order */
const volatile __u32 cfg_max_words = BGS_DEFAULT_MAX_WORDS;
const volatile __u32 cfg_max_head = 8192;
const volatile __u64 cfg_req_mask = 1;      /* request capacity - 1 */
const volatile __u64 cfg_comp_mask = 1;     /* side region: completion capacity - 1 */
const volatile __u64 cfg_comp_off = 8192;   /* side region: completion_slots_offset */
const volatile __u64 cfg_main_comp_off = 8192; /* ring region: completion_slots_offset (same
                                                * capacity as the side region's) */

/* ---- counters (per-CPU; indices generated from crates/bpf/src/counter_index.rs) ---- */
#include "bgs_counters.h"

struct counters {
	__u64 v[C_NUM];
};

/* ---- per-connection state ---- */
enum { MODE_NONE = 0, MODE_BIN = 1, MODE_HTTP = 2 };
enum { PH_FRAME = 0, PH_PAYLOAD = 1, PH_HEAD = 2, PH_BODY = 3 };
enum { RT_SUBMIT = 1, RT_NOT_FOUND = 2, RT_METHOD = 3 };

#define F_CLOSED 0x1         /* closing item published: drop all further input */
#define F_FAILED 0x2         /* an item could not be published anywhere */
#define F_RESET_PENDING 0x4  /* RESET marker still owed */
#define F_EOF_PENDING 0x8    /* peer sent FIN; EOF marker owed once all data is framed */
#define F_EOF_SENT 0x10
#define F_RESET_SENT 0x20
#define F_SERVER_CLOSED 0x40 /* our side closed (FIN_WAIT1 / LAST_ACK) */

/* Candidate bits while matching a header name / a Connection token. */
#define H_CL 1
#define H_TE 2
#define H_CONN 4
#define T_CLOSE 1
#define T_KA 2

enum { IT_NONE = 0, IT_REQ_BUF, IT_REQ_SKB, IT_REJECT };

/* What one step of the framer produced (at most one item per step). */
struct item {
	__u32 kind;
	__u32 skb_off;   /* IT_REQ_SKB: payload offset in the skb */
	__u32 op;
	__u32 request_id;
	__u32 words;
	__u32 param;     /* request param, or the rejection's frame status (0: none) */
	__u32 flags;
	__u32 route;
};

/* HTTP head parse state; zeroed at the start of every request. */
struct head_state {
	__u32 head_len;   /* bytes of the head so far */
	__u32 line;       /* lines completed so far (0: in the request line) */
	__u32 plen;       /* length of the current request-line part / header name (saturating) */
	__u32 vlen;       /* token length in a Connection value */
	__u64 cl_cur;     /* Content-Length digits of this line */
	__u64 cl_val;     /* Content-Length seen so far */
	__u32 body_len;
	__u32 body_have;
	__u8 crlf;        /* progress through "\r\n\r\n" (0..3) */
	__u8 pcr;         /* a '\r' was seen and not yet classified */
	__u8 bad;         /* the head is malformed (reported when it ends: 400) */
	__u8 part;        /* request-line part index */
	__u8 m_post;      /* method matches "POST" so far */
	__u8 t_sub;       /* target matches "/v1/submit" so far */
	__u8 v_ok;        /* version matches "HTTP/1." so far */
	__u8 v_minor;     /* '0' or '1' */
	__u8 is_post;
	__u8 is_submit;
	__u8 keep_alive;
	__u8 in_value;    /* past the colon of a header line */
	__u8 cand;        /* H_* candidates for the header name */
	__u8 hkind;       /* H_* of the current line's name, 0 = other */
	__u8 cl_phase;    /* 0 leading OWS, 1 digits, 2 trailing OWS */
	__u8 cl_digits;
	__u8 cl_bad;
	__u8 cl_seen;
	__u8 chunked;
	__u8 tk_phase;    /* Connection token: 0 leading OWS, 1 token, 2 trailing OWS */
	__u8 tk_cand;     /* T_* candidates */
	__u8 route;       /* RT_* once the head is complete */
	__u8 pad[2];
};

struct conn {
	__u64 cookie;
	__u64 bytes_seen;     /* bytes the verdict has seen (framed or dropped) */
	__u64 eof_at;         /* data bytes before the peer's FIN (valid with F_EOF_PENDING) */
	__u32 next_seq;       /* conn_seq of the next published item */
	__u32 flags;          /* F_* */
	__u8 mode;            /* MODE_* */
	__u8 phase;           /* PH_* */
	__u8 fdone;           /* HTTP body: the frame is complete and valid */
	__u8 pad0;
	__u32 fhave;          /* bytes of the current frame (header + payload) */
	__u32 ferr;           /* HTTP body: status of the first frame error, 0 = none */
	__u32 ferr_id;
	__u32 cache_base;     /* skb offset of cache[0] */
	__u32 cache_len;      /* valid bytes in cache (0 at the start of every skb) */
	__u32 off;            /* framing position in the current skb */
	__u32 len;            /* length of the current skb */
	struct item it;       /* the item produced by the last step */
	__u32 stop;           /* bgs_step: stop the inner loop */
	union {
		__u8 b[32];
		struct bgs_wire_request_header h;
	} hdr;
	struct head_state hs;
	__u8 cache[64];
	/* Payload of a frame that spans segments. Twice the slot size so that the verifier can
	 * prove `buf + have` (have <= SLOT_BYTES) plus a copy of up to SLOT_BYTES in bounds. */
	__u8 buf[2 * SLOT_BYTES];
};

/* ---- maps ---- */
/* The ring region: one element whose value is the whole region (value_size and the masks are
 * set by the loader). No BTF key/value types so that the loader can resize the value. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__uint(key_size, 4);
	__uint(value_size, 4096 * 3);
} ring_map SEC(".maps");

/* The side region: a second ring region whose completion ring carries what BPF answers itself
 * (busy, rejections that found the request ring full, EOF / RESET markers). The executor's
 * completion ring in ring_map then has producers on one side only: a GPU publishing there
 * cannot share a compare-and-swap target with CPUs when the link has no host-native atomics.
 * Its request ring is unused. Sized by the loader like ring_map. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__uint(key_size, 4);
	__uint(value_size, 4096 * 3);
} side_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u64);
} sockhash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct conn);
} conn_states SEC(".maps");

/* A zeroed struct conn used as the initial value of new entries (too big for the stack). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct conn);
} conn_zero SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counters);
} counters SEC(".maps");

/* Doorbell: a record is written (with a forced wake-up) when a sleeping consumer is announced
 * in the ring header after BPF published. Userspace epolls the ringbuf fd. */
struct doorbell_rec {
	__u32 ring;   /* 1 request ring, 2 completion ring, 3 failed connection */
	__u32 pad;
	__u64 cookie;
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096 * 4);
} doorbell SEC(".maps");

/* ---- completion watch (docs/kernel.md, "The completion watch") ----
 * With an executor that cannot wake the reply loop (the GPU), BPF looks at the completion ring
 * on a timer instead of ringing the doorbell when a request arrives: the loop then wakes once,
 * when the reply is there, instead of at the request and again at its own timer. Control words
 * (indices generated from crates/bpf/src/watch_index.rs) in an mmapable array the loader
 * writes; the timer itself in a map of its own (a bpf_timer cannot live in mmapable memory). */
#include "bgs_watch.h"

struct watch_ctl {
	__u64 v[W_NUM];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct watch_ctl);
} watch_ctl SEC(".maps");

struct watch_timer {
	struct bpf_timer t;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct watch_timer);
} watch_timer SEC(".maps");

/* Connections that lost an item because both rings were full (cookie -> 1). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u32);
} failed_conns SEC(".maps");

/* ---- small helpers ---- */
static __always_inline void cnt_add(__u32 idx, __u64 n)
{
	__u32 zero = 0;
	struct counters *c = bpf_map_lookup_elem(&counters, &zero);
	if (c && idx < C_NUM)
		__sync_fetch_and_add(&c->v[idx], n);
}

static __always_inline __u32 http_index(__u32 code)
{
	switch (code) {
	case 400: return 0;
	case 404: return 1;
	case 405: return 2;
	case 411: return 3;
	case 413: return 4;
	case 431: return 5;
	default: return 6;
	}
}

/* Byte i of a literal given as little-endian u64 chunks (a: bytes 0..8, b: 8..16, c: 16..24). */
static __always_inline __u8 lit_at(__u64 a, __u64 b, __u64 c, __u32 i)
{
	__u64 w = i < 8 ? a : (i < 16 ? b : c);
	return (__u8)(w >> ((i & 7) * 8));
}

#define LIT_POST 0x54534f50ULL                                  /* "POST" */
#define LIT_SUBMIT0 0x6d6275732f31762fULL                       /* "/v1/subm" */
#define LIT_SUBMIT1 0x7469ULL                                   /* "it" */
#define LIT_HTTP1 0x2e312f50545448ULL                           /* "HTTP/1." */
#define LIT_CL0 0x2d746e65746e6f63ULL                           /* "content-" */
#define LIT_CL1 0x6874676e656cULL                               /* "length" */
#define LIT_TE0 0x726566736e617274ULL                           /* "transfer" */
#define LIT_TE1 0x6e69646f636e652dULL                           /* "-encodin" */
#define LIT_TE2 0x67ULL                                         /* "g" */
#define LIT_CONN0 0x697463656e6e6f63ULL                         /* "connecti" */
#define LIT_CONN1 0x6e6fULL                                     /* "on" */
#define LIT_CLOSE 0x65736f6c63ULL                               /* "close" */
#define LIT_KA0 0x696c612d7065656bULL                           /* "keep-ali" */
#define LIT_KA1 0x6576ULL                                       /* "ve" */

static __always_inline __u8 lower(__u8 c)
{
	return (c >= 'A' && c <= 'Z') ? c | 0x20 : c;
}

static __always_inline int is_ows(__u8 c)
{
	return c == ' ' || c == '\t';
}

static __always_inline __u32 status_http(__u32 status)
{
	return status == BGS_STATUS_PAYLOAD_TOO_LARGE ? 413 : 400;
}

static __always_inline int status_closes(__u32 status)
{
	return status == BGS_STATUS_BAD_MAGIC || status == BGS_STATUS_BAD_VERSION ||
	       status == BGS_STATUS_PAYLOAD_TOO_LARGE || status == BGS_STATUS_BAD_FLAGS;
}

/* ---- rings ---- */
/* Ring slots are addressed from the region base; the masks and offsets are rodata constants,
 * so the verifier can bound every slot access by the map's value size. */
static __always_inline struct bgs_request_slot *req_slot(void *region, __u64 pos)
{
	__u64 off = BGS_RING_HEADER_SIZE + (pos & cfg_req_mask) * BGS_RING_REQUEST_SLOT_SIZE;
	return (struct bgs_request_slot *)(region + off);
}

static __always_inline struct bgs_completion_slot *comp_slot(void *region, __u64 pos)
{
	__u64 off = cfg_comp_off + (pos & cfg_comp_mask) * BGS_RING_COMPLETION_SLOT_SIZE;
	return (struct bgs_completion_slot *)(region + off);
}

static __always_inline void *region_ptr(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&ring_map, &zero);
}

static __always_inline void *side_region_ptr(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&side_map, &zero);
}

/* Vyukov claim (docs/ring.md "Push", steps 1-2), one attempt per bpf_loop iteration (a
 * bpf_loop callback is verified once, a bounded loop once per iteration). An attempt fails
 * only when another producer claimed the position in between; after CLAIM_TRIES of those the
 * claim gives up and counts as full. */
struct claim {
	__u64 pos;
	__u32 comp;     /* 0: request ring (ring_map), 1: completion ring (side_map) */
	__s32 result;   /* 0 claimed, -1 full, 1 still trying */
};

/* One claim attempt on a ring whose tail and slot seq are given. */
static __always_inline long claim_step(struct claim *cl, __u64 *tail, __u64 seq)
{
	__u64 pos = cl->pos;
	barrier();
	__s64 d = (__s64)(seq - pos);
	if (d == 0) {
		__u64 old = __sync_val_compare_and_swap(tail, pos, pos + 1);
		if (old == pos) {
			cl->result = 0;
			return 1;
		}
		cl->pos = old;
	} else if (d < 0) {
		cl->result = -1;
		return 1;
	} else {
		cl->pos = READ_ONCE(*tail);
	}
	return 0;
}

/* The two rings get separate callbacks: with one callback selecting region and slot offsets
 * by `comp`, clang may compute the map pointer and the offset under separate branches, and the
 * verifier then sees the side map's pointer with a request-ring offset (out of its bounds). */
static long claim_req_cb(__u32 i, void *data)
{
	struct claim *cl = data;
	void *region = region_ptr();
	if (!region) {
		cl->result = -1;
		return 1;
	}
	struct bgs_ring_header *h = region;
	return claim_step(cl, &h->request_tail, READ_ONCE(req_slot(region, cl->pos)->seq));
}

static long claim_comp_cb(__u32 i, void *data)
{
	struct claim *cl = data;
	void *region = side_region_ptr();
	if (!region) {
		cl->result = -1;
		return 1;
	}
	struct bgs_ring_header *h = region;
	return claim_step(cl, &h->completion_tail, READ_ONCE(comp_slot(region, cl->pos)->seq));
}

static __always_inline int claim(void *region, __u32 comp, __u64 *out)
{
	struct bgs_ring_header *h = region;
	struct claim cl = {
		.pos = comp ? READ_ONCE(h->completion_tail) : READ_ONCE(h->request_tail),
		.comp = comp,
		.result = 1,
	};
	if (comp)
		bpf_loop(CLAIM_TRIES, claim_comp_cb, &cl, 0);
	else
		bpf_loop(CLAIM_TRIES, claim_req_cb, &cl, 0);
	if (cl.result == 1)
		cnt_add(C_CLAIM_CONTENDED, 1);
	*out = cl.pos;
	return cl.result == 0 ? 0 : -1;
}

/* Publish (step 4): the seq store must be the last write. An atomic exchange is a full barrier
 * on every JIT (x86 `xchg`, arm64 `swpal`), so it is a release store and also the SeqCst fence
 * the eventcount handshake needs before the producer reads `*_waiters`. */
static __always_inline void publish_seq(__u64 *seq, __u64 v)
{
	barrier();
	__atomic_exchange_n(seq, v, __ATOMIC_SEQ_CST);
}

static __always_inline void ring_doorbell(__u32 ring, __u64 cookie)
{
	struct doorbell_rec r = { .ring = ring, .cookie = cookie };
	bpf_ringbuf_output(&doorbell, &r, sizeof(r), BPF_RB_FORCE_WAKEUP);
	cnt_add(C_DOORBELLS, 1);
}

#define CLOCK_MONOTONIC 1
/* Shortest gap between looks (ns): below it a look costs more than it can save. */
#define WATCH_MIN_NS 2000ULL

/* Whether the executor's completion ring (in the ring region) has a published entry at its
 * head: the consumer's next pop would succeed (docs/ring.md, "Pop"). */
static __always_inline int completion_ready(void *region)
{
	struct bgs_ring_header *h = region;
	__u64 head = READ_ONCE(h->completion_head);
	__u64 off = cfg_main_comp_off + (head & cfg_comp_mask) * BGS_RING_COMPLETION_SLOT_SIZE;
	struct bgs_completion_slot *s = (struct bgs_completion_slot *)(region + off);
	return READ_ONCE(s->seq) == head + 1;
}

static int watch_fire(void *map, __u32 *key, struct watch_timer *t);

/* Schedule the next look `delay` ns from now. The caller holds W_ARMED (it set it 0 -> 1).
 * Returns 0 if the timer runs; otherwise W_ARMED is released and the caller must ring. */
static __always_inline int watch_start(struct watch_ctl *w, __u64 delay)
{
	__u32 zero = 0;
	struct watch_timer *t = bpf_map_lookup_elem(&watch_timer, &zero);
	if (!t)
		goto fail;
	/* Initialize once (both helpers take the timer's lock: not on every arm). The loader
	 * holds the map's fd: a timer map nobody in user space holds refuses with -EPERM. An arm
	 * that finds another one initializing rings instead (once, at start). */
	if (READ_ONCE(w->v[W_TIMER_STATE]) != 2) {
		if (__sync_val_compare_and_swap(&w->v[W_TIMER_STATE], 0, 1) != 0)
			goto busy;
		bpf_timer_init(&t->t, &watch_timer, CLOCK_MONOTONIC);
		if (bpf_timer_set_callback(&t->t, watch_fire)) {
			WRITE_ONCE(w->v[W_TIMER_STATE], 0);
			goto fail;
		}
		__atomic_exchange_n(&w->v[W_TIMER_STATE], 2, __ATOMIC_SEQ_CST);
	}
	w->v[W_DELAY_NS] = delay;
	if (bpf_timer_start(&t->t, delay, 0))
		goto fail;
	return 0;
fail:
	cnt_add(C_INTERNAL, 1);
busy:
	__atomic_exchange_n(&w->v[W_ARMED], 0, __ATOMIC_SEQ_CST);
	return -1;
}

/* A look. Ordering (all full barriers): a publisher publishes its request, then reads
 * request_waiters, then takes W_ARMED; the look releases W_ARMED, then reads the completion
 * ring, request_waiters and request_tail. So a request whose publisher found the look already
 * scheduled is seen by the look (or by the loop, awake): none is left unwatched while the
 * loop sleeps. */
static int watch_fire(void *map, __u32 *key, struct watch_timer *t)
{
	__u32 zero = 0;
	struct watch_ctl *w = bpf_map_lookup_elem(&watch_ctl, &zero);
	void *region = region_ptr();
	if (!w || !region)
		return 0;
	struct bgs_ring_header *h = region;
	__atomic_exchange_n(&w->v[W_ARMED], 0, __ATOMIC_SEQ_CST);
	__u64 first = READ_ONCE(w->v[W_FIRST_NS]);
	__u64 max = READ_ONCE(w->v[W_MAX_NS]);
	if (completion_ready(region)) {
		/* Learn the first delay like the native transport's pacer: a first look that
		 * found the reply may have been late, so move earlier by a sixteenth; a reply
		 * found by a later look moves it a quarter of the way to when that was. */
		__u64 since = bpf_ktime_get_ns() - READ_ONCE(w->v[W_ARMED_AT]);
		if (READ_ONCE(w->v[W_LOOKS]) == 0)
			first -= first / 16;
		else if (since > first)
			first += (since - first) / 4;
		if (first < WATCH_MIN_NS)
			first = WATCH_MIN_NS;
		if (first > max)
			first = max;
		WRITE_ONCE(w->v[W_FIRST_NS], first);
		/* An awake loop sees the completion before it sleeps again (it announces itself,
		 * then checks the ring; or it finds no look scheduled and sets its own timer). */
		if (READ_ONCE(h->request_waiters)) {
			ring_doorbell(2, 0);
			cnt_add(C_WATCH_RINGS, 1);
		}
		return 0;
	}
	cnt_add(C_WATCH_MISSES, 1);
	/* The loop is awake: it sees what is executing before it sleeps again. */
	if (!READ_ONCE(h->request_waiters))
		return 0;
	/* Nothing left in the executor (answered lags behind, so this errs towards looking). */
	if (READ_ONCE(h->request_tail) == READ_ONCE(w->v[W_ANSWERED]))
		return 0;
	__u64 delay = READ_ONCE(w->v[W_LOOKS]) == 0 ? first / 4 : READ_ONCE(w->v[W_DELAY_NS]) * 2;
	if (delay < WATCH_MIN_NS)
		delay = WATCH_MIN_NS;
	if (delay > max)
		delay = max;
	if (__sync_val_compare_and_swap(&w->v[W_ARMED], 0, 1) != 0)
		return 0; /* a publisher scheduled a look meanwhile */
	w->v[W_LOOKS] += 1;
	if (watch_start(w, delay))
		ring_doorbell(2, 0);
	return 0;
}

/* A request was published and the reply loop may sleep: with the watch on, schedule a look at
 * the completion ring instead of waking the loop now (or rely on the one scheduled). */
static __always_inline int watch_request(void)
{
	__u32 zero = 0;
	struct watch_ctl *w = bpf_map_lookup_elem(&watch_ctl, &zero);
	if (!w || !READ_ONCE(w->v[W_ON]))
		return -1;
	if (__sync_val_compare_and_swap(&w->v[W_ARMED], 0, 1) != 0) {
		cnt_add(C_WATCH_COVERED, 1);
		return 0;
	}
	WRITE_ONCE(w->v[W_ARMED_AT], bpf_ktime_get_ns());
	WRITE_ONCE(w->v[W_LOOKS], 0);
	if (watch_start(w, READ_ONCE(w->v[W_FIRST_NS])))
		return -1;
	cnt_add(C_WATCH_ARMS, 1);
	return 0;
}

static __always_inline void notify(void *region, __u32 ring, __u64 cookie)
{
	struct bgs_ring_header *h = region;
	__u32 w = ring == 1 ? READ_ONCE(h->request_waiters) : READ_ONCE(h->completion_waiters);
	if (!w)
		return;
	if (ring == 1 && watch_request() == 0)
		return;
	ring_doorbell(ring, cookie);
}

/* A completion published by BPF itself: busy, a rejection that found the request ring full,
 * or an EOF / RESET marker. It goes to the side region's completion ring (see side_map).
 * `op` is the request's op (BGS_RING_OP_REJECT for a rejection, 0 for a marker) and the
 * completion's publish_ns is now: the reply stage counts answered requests from them. */
static __always_inline int push_completion(void *unused, __u64 cookie, __u32 conn_seq,
					   __u32 status, __u32 request_id, __u32 route,
					   __u32 op)
{
	void *region = side_region_ptr();
	__u64 pos;
	if (!region)
		return -1;
	if (claim(region, 1, &pos))
		return -1;
	struct bgs_completion_slot *s = comp_slot(region, pos);
	s->entry.conn = cookie;
	s->entry.conn_seq = conn_seq;
	s->entry.status = (__u16)status;
	s->entry.final_ = 1;
	s->entry.request_id = request_id;
	s->entry.words = 0;
	s->entry.stream_seq = 0;
	s->entry.route = route;
	s->entry.stream = 0;
	s->entry.op = op;
	s->entry.publish_ns = bpf_ktime_get_ns();
	s->entry.reserved[0] = 0;
	s->entry.reserved[1] = 0;
	publish_seq(&s->seq, pos + 1);
	notify(region, 2, cookie);
	return 0;
}

static __always_inline void mark_failed(struct conn *st)
{
	__u32 one = 1;
	st->flags |= F_FAILED | F_CLOSED | F_RESET_PENDING;
	bpf_map_update_elem(&failed_conns, &st->cookie, &one, BPF_ANY);
	ring_doorbell(3, st->cookie);
}

/* EOF / RESET marker into the completion ring, in the connection's order. */
static __always_inline int push_marker(struct conn *st, __u32 route)
{
	void *region = region_ptr();
	if (!region)
		return -1;
	if (push_completion(region, st->cookie, st->next_seq, 0, 0, route, 0)) {
		cnt_add(C_MARKER_FAILED, 1);
		return -1;
	}
	st->next_seq++;
	if (route == BGS_ROUTE_EOF) {
		st->flags |= F_EOF_SENT;
		st->flags &= ~F_EOF_PENDING;
		cnt_add(C_EOF, 1);
	} else {
		st->flags |= F_RESET_SENT;
		st->flags &= ~F_RESET_PENDING;
		cnt_add(C_RESET, 1);
	}
	return 0;
}

/* ---- framing ---- */

struct ctx {
	struct __sk_buff *skb;
	struct conn *st;
	__u32 off;
	__u32 len;
	struct item it;
};

static __always_inline void set_reject(struct ctx *c, __u32 status, __u32 id, __u32 route)
{
	c->it.kind = IT_REJECT;
	c->it.op = BGS_RING_OP_REJECT;
	c->it.request_id = id;
	c->it.words = 0;
	c->it.param = status;
	c->it.flags = 0;
	c->it.route = route;
}

static __always_inline void set_http_reject(struct ctx *c, __u32 code, int close)
{
	set_reject(c, 0, 0,
		   BGS_ROUTE_HTTP | BGS_ROUTE_NO_FRAME | (close ? BGS_ROUTE_CLOSE : 0) |
			   ((code & BGS_ROUTE_HTTP_STATUS_MASK) << BGS_ROUTE_HTTP_STATUS_SHIFT));
}

/* A frame error / semantic rejection; in HTTP mode the body is the error frame. */
static __always_inline void set_frame_reject(struct ctx *c, __u32 status, __u32 id, int http,
					     int close_http)
{
	__u32 route = 0;
	if (http) {
		route = BGS_ROUTE_HTTP | (status_http(status) << BGS_ROUTE_HTTP_STATUS_SHIFT);
		if (status_closes(status) || close_http)
			route |= BGS_ROUTE_CLOSE;
	} else if (status_closes(status)) {
		route = BGS_ROUTE_CLOSE;
	}
	set_reject(c, status, id, route);
}

static __always_inline void set_request(struct ctx *c, __u32 kind, __u32 route)
{
	struct conn *st = c->st;
	c->it.kind = kind;
	c->it.op = st->hdr.h.op;
	c->it.request_id = st->hdr.h.request_id;
	c->it.words = st->hdr.h.words;
	c->it.param = st->hdr.h.param;
	c->it.flags = st->hdr.h.flags;
	c->it.route = route;
}

/* One byte of a frame header, checks in wire order (framer.rs `check_frame`). Returns the
 * frame status of an error (request id in st->ferr_id), or 0. */
static __always_inline __u32 frame_byte(struct conn *st, __u8 b)
{
	__u32 i = st->fhave;
	if (i >= BGS_HEADER_LEN)
		return 0;
	st->hdr.b[i & 31] = b;
	st->fhave = i + 1;
	if (i < 4) {
		if (b != (__u8)(BGS_REQUEST_MAGIC >> (8 * i))) {
			st->ferr_id = 0;
			return BGS_STATUS_BAD_MAGIC;
		}
	} else if (i == 5) {
		if (st->hdr.h.version != BGS_VERSION) {
			st->ferr_id = 0;
			return BGS_STATUS_BAD_VERSION;
		}
	} else if (i == 15) {
		if (st->hdr.h.words > cfg_max_words) {
			st->ferr_id = st->hdr.h.request_id;
			return BGS_STATUS_PAYLOAD_TOO_LARGE;
		}
	} else if (i == 23) {
		/* The op (bytes 6..8) is known: only the flag bits it allows (generated op table). */
		if (st->hdr.h.flags & ~bgs_op_allowed_flags(st->hdr.h.op)) {
			st->ferr_id = st->hdr.h.request_id;
			return BGS_STATUS_BAD_FLAGS;
		}
	}
	return 0;
}

/* Semantic checks of a complete frame; 0 when it is a valid request. The rules are the op
 * table of crates/protocol/src/ops.rs, rendered into bgs_protocol.h. */
static __always_inline __u32 frame_semantic(struct conn *st)
{
	return bgs_op_check(st->hdr.h.op, st->hdr.h.words, st->hdr.h.param);
}

/* A complete binary frame: a request or a (non-closing) semantic rejection. */
static __always_inline void finish_binary(struct ctx *c, __u32 kind)
{
	struct conn *st = c->st;
	__u32 sem = frame_semantic(st);
	if (sem)
		set_frame_reject(c, sem, st->hdr.h.request_id, 0, 0);
	else
		set_request(c, kind, 0);
	st->fhave = 0;
	st->phase = PH_FRAME;
}

/* Copy up to `want` bytes of the skb at c->off into st->buf at `at`; returns bytes copied. */
static __always_inline __u32 copy_to_buf(struct ctx *c, __u32 at, __u32 want)
{
	struct conn *st = c->st;
	__u32 n = c->len - c->off;
	if (n > want)
		n = want;
	if (n > SLOT_BYTES)
		n = SLOT_BYTES;
	if (at >= SLOT_BYTES || n == 0)
		return 0;
	n = ((n - 1) & (SLOT_BYTES - 1)) + 1; /* [1, SLOT_BYTES] for the verifier */
	if (bpf_skb_load_bytes(c->skb, c->off, &st->buf[at & (SLOT_BYTES - 1)], n))
		cnt_add(C_INTERNAL, 1);
	return n;
}

static __always_inline void body_end(struct ctx *c);

/* ---- HTTP head, one byte at a time (framer.rs `parse_http_head`) ---- */

static __always_inline void reqline_char(struct head_state *hs, __u8 ch)
{
	__u32 n = hs->plen;
	if (ch == ' ') {
		if (hs->part == 0) {
			if (n == 0)
				hs->bad = 1;
			hs->is_post = hs->m_post && n == 4;
		} else if (hs->part == 1) {
			if (n == 0)
				hs->bad = 1;
			hs->is_submit = hs->t_sub && n == 10;
		} else {
			hs->bad = 1; /* a fourth part */
		}
		if (hs->part < 3)
			hs->part++;
		hs->plen = 0;
		return;
	}
	if (hs->part == 0) {
		if (ch < 'A' || ch > 'Z')
			hs->bad = 1;
		if (n >= 4 || ch != lit_at(LIT_POST, 0, 0, n & 7))
			hs->m_post = 0;
	} else if (hs->part == 1) {
		if (n >= 10 || ch != lit_at(LIT_SUBMIT0, LIT_SUBMIT1, 0, n & 15))
			hs->t_sub = 0;
	} else if (hs->part == 2) {
		if (n < 7) {
			if (ch != lit_at(LIT_HTTP1, 0, 0, n & 7))
				hs->v_ok = 0;
		} else if (n == 7) {
			if (ch == '0' || ch == '1')
				hs->v_minor = ch;
			else
				hs->v_ok = 0;
		} else {
			hs->v_ok = 0;
		}
	}
	if (n < 0xffff)
		hs->plen = n + 1;
}

static __always_inline void reqline_end(struct head_state *hs)
{
	if (hs->part != 2 || hs->plen != 8 || !hs->v_ok) {
		hs->bad = 1;
		return;
	}
	hs->keep_alive = hs->v_minor == '1';
}

static __always_inline void conn_token_end(struct head_state *hs)
{
	if ((hs->tk_cand & T_CLOSE) && hs->vlen == 5)
		hs->keep_alive = 0;
	else if ((hs->tk_cand & T_KA) && hs->vlen == 10)
		hs->keep_alive = 1;
	hs->tk_phase = 0;
	hs->tk_cand = T_CLOSE | T_KA;
	hs->vlen = 0;
}

static __always_inline void conn_token_char(struct head_state *hs, __u8 ch)
{
	__u32 n = hs->vlen;
	__u8 lc = lower(ch);
	if (ch == ',') {
		conn_token_end(hs);
		return;
	}
	if (is_ows(ch)) {
		if (hs->tk_phase == 1)
			hs->tk_phase = 2;
		return;
	}
	if (hs->tk_phase == 2)
		hs->tk_cand = 0; /* whitespace inside the token */
	hs->tk_phase = 1;
	if (n >= 5 || lc != lit_at(LIT_CLOSE, 0, 0, n & 7))
		hs->tk_cand &= ~T_CLOSE;
	if (n >= 10 || lc != lit_at(LIT_KA0, LIT_KA1, 0, n & 15))
		hs->tk_cand &= ~T_KA;
	if (n < 0xffff)
		hs->vlen = n + 1;
}

static __always_inline void cl_char(struct head_state *hs, __u8 ch)
{
	int digit = ch >= '0' && ch <= '9';
	if (hs->cl_phase == 0) {
		if (is_ows(ch))
			return;
		hs->cl_phase = 1;
	}
	if (hs->cl_phase == 1) {
		if (digit) {
			if (hs->cl_digits >= 10) {
				hs->cl_bad = 1;
				return;
			}
			hs->cl_digits++;
			hs->cl_cur = hs->cl_cur * 10 + (ch - '0');
			return;
		}
		if (is_ows(ch)) {
			hs->cl_phase = 2;
			return;
		}
		hs->cl_bad = 1;
		return;
	}
	if (!is_ows(ch))
		hs->cl_bad = 1;
}

static __always_inline void header_char(struct head_state *hs, __u8 ch)
{
	if (!hs->in_value) {
		__u32 n = hs->plen;
		if (ch == ':') {
			if (n == 0)
				hs->bad = 1;
			hs->in_value = 1;
			hs->hkind = 0;
			if ((hs->cand & H_CL) && n == 14)
				hs->hkind = H_CL;
			else if ((hs->cand & H_TE) && n == 17)
				hs->hkind = H_TE;
			else if ((hs->cand & H_CONN) && n == 10)
				hs->hkind = H_CONN;
			if (hs->hkind == H_TE)
				hs->chunked = 1;
			hs->cl_phase = 0;
			hs->cl_digits = 0;
			hs->cl_bad = 0;
			hs->cl_cur = 0;
			hs->tk_phase = 0;
			hs->tk_cand = T_CLOSE | T_KA;
			hs->vlen = 0;
			return;
		}
		if (ch < 0x21 || ch > 0x7e)
			hs->bad = 1;
		__u8 lc = lower(ch);
		if (n >= 14 || lc != lit_at(LIT_CL0, LIT_CL1, 0, n & 15))
			hs->cand &= ~H_CL;
		if (n >= 17 || lc != lit_at(LIT_TE0, LIT_TE1, LIT_TE2, n & 31))
			hs->cand &= ~H_TE;
		if (n >= 10 || lc != lit_at(LIT_CONN0, LIT_CONN1, 0, n & 15))
			hs->cand &= ~H_CONN;
		if (n < 0xffff)
			hs->plen = n + 1;
		return;
	}
	if (hs->hkind == H_CL)
		cl_char(hs, ch);
	else if (hs->hkind == H_CONN)
		conn_token_char(hs, ch);
}

static __always_inline void header_end(struct head_state *hs)
{
	if (!hs->in_value) {
		hs->bad = 1; /* no colon */
		return;
	}
	if (hs->hkind == H_CL) {
		if (hs->cl_bad || hs->cl_digits == 0) {
			hs->bad = 1;
		} else if (hs->cl_seen && hs->cl_val != hs->cl_cur) {
			hs->bad = 1;
		} else {
			hs->cl_seen = 1;
			hs->cl_val = hs->cl_cur;
		}
	} else if (hs->hkind == H_CONN) {
		conn_token_end(hs);
	}
}

/* One character of a line's content (CR/LF handling is done by the caller). */
static __always_inline void line_char(struct head_state *hs, __u8 ch)
{
	if (hs->bad)
		return;
	if (hs->line == 0)
		reqline_char(hs, ch);
	else
		header_char(hs, ch);
}

/* A line ended with CRLF (ok) or a bare LF (!ok). */
static __always_inline void line_end(struct head_state *hs, int ok)
{
	if (!ok)
		hs->bad = 1;
	if (!hs->bad) {
		if (hs->line == 0)
			reqline_end(hs);
		else
			header_end(hs);
	}
	hs->line++;
	hs->plen = 0;
	hs->in_value = 0;
	hs->cand = H_CL | H_TE | H_CONN;
}

static __always_inline void reset_head(struct conn *st)
{
	struct head_state *hs = &st->hs;
	__builtin_memset(hs, 0, sizeof(*hs));
	hs->m_post = 1;
	hs->t_sub = 1;
	hs->v_ok = 1;
	hs->cand = H_CL | H_TE | H_CONN;
	st->fhave = 0;
	st->ferr = 0;
	st->ferr_id = 0;
	st->fdone = 0;
	st->phase = PH_HEAD;
}

/* The head is complete: decide (framer.rs, end of `parse_http_head`). */
static __always_inline void head_done(struct ctx *c)
{
	struct conn *st = c->st;
	struct head_state *hs = &st->hs;
	if (hs->bad) {
		set_http_reject(c, 400, 1);
		return;
	}
	__u8 route = !hs->is_submit ? RT_NOT_FOUND : (hs->is_post ? RT_SUBMIT : RT_METHOD);
	hs->route = route;
	if (hs->chunked) {
		set_http_reject(c, 411, 1);
		return;
	}
	__u64 limit = BGS_HEADER_LEN + 4 * (__u64)cfg_max_words;
	if (!hs->cl_seen) {
		if (route == RT_SUBMIT) {
			set_http_reject(c, 411, 1);
			return;
		}
		hs->body_len = 0;
	} else if (hs->cl_val > limit) {
		if (route == RT_SUBMIT)
			set_frame_reject(c, BGS_STATUS_PAYLOAD_TOO_LARGE, 0, 1, 1);
		else
			set_http_reject(c, route == RT_NOT_FOUND ? 404 : 405, 1);
		return;
	} else {
		hs->body_len = (__u32)hs->cl_val;
	}
	st->phase = PH_BODY;
	hs->body_have = 0;
	st->fhave = 0;
	st->ferr = 0;
	st->fdone = 0;
	if (hs->body_len == 0)
		body_end(c);
}

static __always_inline void head_byte(struct ctx *c, __u8 b)
{
	struct conn *st = c->st;
	struct head_state *hs = &st->hs;
	hs->head_len++;
	/* "\r\n\r\n" matcher (framer.rs `find_head_end`). */
	__u8 m = hs->crlf;
	int end = 0;
	if (b == '\r')
		m = m == 2 ? 3 : 1;
	else if (b == '\n') {
		if (m == 3)
			end = 1;
		m = m == 1 ? 2 : 0;
	} else
		m = 0;
	hs->crlf = m;
	if (end) {
		/* The final CRLF terminates the blank line, which is not a head line. */
		head_done(c);
		return;
	}
	if (b == '\n') {
		line_end(hs, hs->pcr);
		hs->pcr = 0;
	} else if (b == '\r') {
		if (hs->pcr)
			line_char(hs, '\r');
		hs->pcr = 1;
	} else {
		if (hs->pcr)
			line_char(hs, '\r');
		hs->pcr = 0;
		line_char(hs, b);
	}
	if (hs->head_len >= cfg_max_head)
		set_http_reject(c, 431, 1);
}

/* The body is complete (framer.rs `decode_http`, after the head). */
static __always_inline void body_end(struct ctx *c)
{
	struct conn *st = c->st;
	struct head_state *hs = &st->hs;
	int close = !hs->keep_alive;
	if (hs->route == RT_NOT_FOUND) {
		set_http_reject(c, 404, close);
	} else if (hs->route == RT_METHOD) {
		set_http_reject(c, 405, close);
	} else if (st->ferr) {
		set_frame_reject(c, st->ferr, st->ferr_id, 1, close);
	} else if (!st->fdone || st->fhave != hs->body_len) {
		set_http_reject(c, 400, close);
	} else {
		set_request(c, IT_REQ_BUF, BGS_ROUTE_HTTP | (close ? BGS_ROUTE_CLOSE : 0));
	}
	reset_head(st);
}

/* The frame inside an HTTP body is complete: run the semantic checks, remember the result. */
static __always_inline void body_frame_done(struct conn *st)
{
	__u32 sem = frame_semantic(st);
	if (sem) {
		st->ferr = sem;
		st->ferr_id = st->hdr.h.request_id;
	} else {
		st->fdone = 1;
	}
}

static __always_inline __u8 get_byte(struct ctx *c)
{
	struct conn *st = c->st;
	__u32 rel = c->off - st->cache_base;
	if (rel >= st->cache_len) {
		__u32 n = c->len - c->off;
		if (n == 0)
			return 0;
		if (n > sizeof(st->cache))
			n = sizeof(st->cache);
		n = ((n - 1) & 63) + 1; /* [1, 64] for the verifier */
		if (bpf_skb_load_bytes(c->skb, c->off, st->cache, n))
			cnt_add(C_INTERNAL, 1);
		st->cache_base = c->off;
		st->cache_len = n;
		rel = 0;
	}
	return st->cache[rel & 63];
}

/* The fast path of the binary header: when a frame starts here and its whole header is in
 * this skb, load it at once and, if frame_byte would accept every byte of it, take it in one
 * step instead of 24 (each a bpf_loop iteration: most of the verdict's cost per request). A
 * header that breaks any rule is left to the byte-wise path, which finds the same error at
 * the same byte; so the rules stay those of frame_byte alone. Returns 1 if it consumed the
 * header. */
static __always_inline int header_at_once(struct ctx *c)
{
	struct conn *st = c->st;
	if (st->fhave != 0 || c->len - c->off < BGS_HEADER_LEN)
		return 0;
	if (bpf_skb_load_bytes(c->skb, c->off, &st->hdr.b[0], BGS_HEADER_LEN))
		return 0;
	if (st->hdr.h.magic != BGS_REQUEST_MAGIC || st->hdr.h.version != BGS_VERSION ||
	    st->hdr.h.words > cfg_max_words ||
	    (st->hdr.h.flags & ~bgs_op_allowed_flags(st->hdr.h.op)))
		return 0;
	st->fhave = BGS_HEADER_LEN;
	c->off += BGS_HEADER_LEN;
	return 1;
}

/* Binary mode, one step. */
static __always_inline void step_binary(struct ctx *c)
{
	struct conn *st = c->st;
	if (st->phase == PH_PAYLOAD) {
		__u32 have = st->fhave - BGS_HEADER_LEN;
		__u32 need = st->hdr.h.words * 4 - have;
		__u32 n = copy_to_buf(c, have, need);
		c->off += n;
		st->fhave += n;
		if (n == need)
			finish_binary(c, IT_REQ_BUF);
		return;
	}
	if (!header_at_once(c)) {
		__u8 b = get_byte(c);
		c->off++;
		__u32 err = frame_byte(st, b);
		if (err) {
			set_frame_reject(c, err, st->ferr_id, 0, 0);
			return;
		}
		if (st->fhave < BGS_HEADER_LEN)
			return;
	}
	__u32 plen = st->hdr.h.words * 4;
	if (plen == 0) {
		finish_binary(c, IT_REQ_BUF);
	} else if (plen <= c->len - c->off) {
		/* The whole payload is in this skb: copy it straight into the ring slot. */
		c->it.skb_off = c->off;
		c->off += plen;
		finish_binary(c, IT_REQ_SKB);
	} else {
		st->phase = PH_PAYLOAD;
	}
}

/* HTTP mode, one step. */
static __always_inline void step_http(struct ctx *c)
{
	struct conn *st = c->st;
	struct head_state *hs = &st->hs;
	if (st->phase != PH_BODY) {
		head_byte(c, get_byte(c));
		c->off++;
		return;
	}
	__u32 rem = hs->body_len - hs->body_have;
	if (hs->route != RT_SUBMIT || st->ferr || st->fdone) {
		/* Skip the rest of the body. */
		__u32 n = c->len - c->off;
		if (n > rem)
			n = rem;
		c->off += n;
		hs->body_have += n;
	} else if (st->fhave < BGS_HEADER_LEN) {
		__u8 b = get_byte(c);
		c->off++;
		hs->body_have++;
		__u32 err = frame_byte(st, b);
		if (err) {
			st->ferr = err;
		} else if (st->fhave == BGS_HEADER_LEN && st->hdr.h.words == 0) {
			body_frame_done(st);
		}
	} else {
		__u32 have = st->fhave - BGS_HEADER_LEN;
		__u32 need = st->hdr.h.words * 4 - have;
		if (need > rem)
			need = rem;
		__u32 n = copy_to_buf(c, have, need);
		c->off += n;
		hs->body_have += n;
		st->fhave += n;
		if (st->fhave == BGS_HEADER_LEN + st->hdr.h.words * 4)
			body_frame_done(st);
	}
	if (hs->body_have >= hs->body_len)
		body_end(c);
}

/* Publish the item of this step into the request ring (or, when full, its answer into the
 * completion ring; when both are full the connection fails). */
static __always_inline void publish_item(struct ctx *c)
{
	struct conn *st = c->st;
	struct item *it = &c->it;
	void *region = region_ptr();
	if (!region) {
		cnt_add(C_INTERNAL, 1);
		return;
	}
	__u32 conn_seq = st->next_seq++;
	int reject = it->kind == IT_REJECT;
	cnt_add(C_FRAMES, 1);
	if (reject) {
		__u32 code = (it->route >> BGS_ROUTE_HTTP_STATUS_SHIFT) & BGS_ROUTE_HTTP_STATUS_MASK;
		cnt_add(C_STATUS_BASE + (it->param & 31), 1);
		if (code)
			cnt_add(C_HTTP_BASE + http_index(code), 1);
	}
	if (it->route & BGS_ROUTE_CLOSE)
		st->flags |= F_CLOSED;

	__u64 pos;
	if (claim(region, 0, &pos) == 0) {
		struct bgs_request_slot *s = req_slot(region, pos);
		s->entry.conn = st->cookie;
		s->entry.conn_seq = conn_seq;
		s->entry.op = (__u16)it->op;
		s->entry.version = BGS_VERSION;
		s->entry.request_id = it->request_id;
		s->entry.words = it->words;
		s->entry.param = it->param;
		s->entry.flags = it->flags;
		s->entry.route = it->route;
		s->entry.reserved[0] = 0;
		s->entry.reserved[1] = 0;
		s->entry.reserved[2] = 0;
		__u32 bytes = it->words * 4;
		if (bytes > SLOT_BYTES)
			bytes = SLOT_BYTES;
		if (it->kind == IT_REQ_SKB && bytes > 0) {
			bytes = ((bytes - 1) & (SLOT_BYTES - 1)) + 1;
			if (bpf_skb_load_bytes(c->skb, it->skb_off, &s->entry.payload[0], bytes))
				cnt_add(C_INTERNAL, 1);
		} else if (it->kind == IT_REQ_BUF) {
			/* A constant-size copy is straight-line code for the verifier. */
			__builtin_memcpy(&s->entry.payload[0], &st->buf[0], SLOT_BYTES);
		}
		s->entry.publish_ns = bpf_ktime_get_ns();
		publish_seq(&s->seq, pos + 1);
		notify(region, 1, st->cookie);
		cnt_add(reject ? C_REJECTS : C_REQUESTS, 1);
		return;
	}
	/* Request ring full: answer in place (busy for a request, the rejection itself for a
	 * rejection: exactly the completion the executor would have produced). */
	__u32 status = reject ? it->param : BGS_STATUS_BUSY;
	if (push_completion(region, st->cookie, conn_seq, status, it->request_id, it->route,
			    it->op) == 0) {
		cnt_add(reject ? C_REJECTS_DIRECT : C_BUSY, 1);
		return;
	}
	cnt_add(C_COMP_FULL, 1);
	mark_failed(st);
}

/* One framing step: consumes at least one byte. Returns 1 when the inner loop should stop
 * (it produced an item, the connection closed, or the skb is consumed).
 *
 * A global function: the verifier checks it once, on its own, instead of once per path of
 * every caller (the framer's branches would otherwise multiply past the 1M-insn limit). */
__noinline int bgs_step(struct __sk_buff *skb, struct conn *st)
{
	if (!st)
		return 1;
	st->stop = 1;
	if (!skb)
		return 1;
	struct ctx cc = { .skb = skb, .st = st, .off = st->off, .len = st->len };
	struct ctx *c = &cc;
	cc.it.kind = IT_NONE;
	if (c->off >= c->len)
		return 1;
	if (st->flags & F_CLOSED) {
		cnt_add(C_DROPPED_BYTES, c->len - c->off);
		st->off = c->len;
		return 1;
	}
	if (st->mode == MODE_NONE) {
		__u8 b = get_byte(c);
		/* framer.rs: `B` starts the binary magic; any other upper-case letter an HTTP method. */
		if (b != 'B' && b >= 'A' && b <= 'Z') {
			st->mode = MODE_HTTP;
			reset_head(st);
		} else {
			st->mode = MODE_BIN;
			st->phase = PH_FRAME;
		}
	}
	if (st->mode == MODE_HTTP)
		step_http(c);
	else
		step_binary(c);
	st->off = c->off;
	st->it = cc.it;
	st->stop = cc.it.kind != IT_NONE;
	return 0;
}

/* Publish st->it (a global function for the same reason as bgs_step). */
__noinline int bgs_publish(struct __sk_buff *skb, struct conn *st)
{
	if (!skb || !st)
		return 0;
	struct ctx cc = { .skb = skb, .st = st, .off = st->off, .len = st->len, .it = st->it };
	if (cc.it.kind != IT_NONE)
		publish_item(&cc);
	st->it.kind = IT_NONE;
	return 0;
}

struct loop_ctx {
	struct __sk_buff *skb;
	struct conn *st;
};

static long step_cb(__u32 idx, void *data)
{
	struct loop_ctx *l = data;
	bgs_step(l->skb, l->st);
	/* Through memory: clang would pass bgs_step's 32-bit result on unmasked. */
	return l->st->stop & 1;
}

/* Frame up to the next item, then publish it. */
static long item_cb(__u32 idx, void *data)
{
	struct loop_ctx *l = data;
	struct conn *st = l->st;
	if (st->off >= st->len || (st->flags & F_CLOSED))
		return 1;
	st->it.kind = IT_NONE;
	bpf_loop(st->len - st->off + 1, step_cb, l, 0);
	bgs_publish(l->skb, st);
	return 0;
}

SEC("sk_skb/verdict")
int bgs_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	struct conn *st = bpf_map_lookup_elem(&conn_states, &cookie);
	__u32 len = skb->len;
	if (!st) {
		cnt_add(C_NO_STATE, 1);
		return SK_DROP;
	}
	st->bytes_seen += len;
	cnt_add(C_BYTES, len);
	if (st->flags & F_RESET_PENDING)
		push_marker(st, BGS_ROUTE_RESET);
	if (len > 0) {
		if (st->flags & F_CLOSED) {
			cnt_add(C_DROPPED_BYTES, len);
		} else {
			struct loop_ctx l = { .skb = skb, .st = st };
			st->off = 0;
			st->len = len;
			st->cache_len = 0;
			st->cache_base = 0;
			/* Every step consumes at least one byte, every item at least one step. */
			bpf_loop(len + 1, item_cb, &l, 0);
		}
	}
	if ((st->flags & F_EOF_PENDING) && st->bytes_seen >= st->eof_at &&
	    !(st->flags & (F_EOF_SENT | F_RESET_SENT | F_FAILED)))
		push_marker(st, BGS_ROUTE_EOF);
	return SK_DROP;
}

/* ---- connections ---- */
static __always_inline void conn_open(struct bpf_sock_ops *ops)
{
	__u64 cookie = bpf_get_socket_cookie(ops);
	__u32 zero = 0;
	struct conn *init = bpf_map_lookup_elem(&conn_zero, &zero);
	if (!init)
		return;
	if (bpf_map_update_elem(&conn_states, &cookie, init, BPF_NOEXIST)) {
		cnt_add(C_CONN_REFUSED, 1);
		return;
	}
	struct conn *st = bpf_map_lookup_elem(&conn_states, &cookie);
	if (!st) {
		cnt_add(C_CONN_REFUSED, 1);
		return;
	}
	st->cookie = cookie;
	if (bpf_sock_hash_update(ops, &sockhash, &cookie, BPF_NOEXIST)) {
		bpf_map_delete_elem(&conn_states, &cookie);
		cnt_add(C_CONN_REFUSED, 1);
		return;
	}
	bpf_sock_ops_cb_flags_set(ops, ops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	cnt_add(C_CONN_OPENED, 1);
}

static __always_inline void conn_state_change(struct bpf_sock_ops *ops)
{
	__u32 new = ops->args[1];
	__u64 cookie = bpf_get_socket_cookie(ops);
	struct conn *st = bpf_map_lookup_elem(&conn_states, &cookie);
	if (!st)
		return;
	if (new == BPF_TCP_CLOSE_WAIT) {
		/* bytes_received counts the FIN as one byte; all data before the FIN is queued by
		 * now. If the verdict has already seen it all, publish now; otherwise the verdict
		 * publishes once it has (tcp_fin runs before tcp_data_ready for a segment that
		 * carries data and FIN, and out-of-order segments can queue several skbs). */
		st->eof_at = ops->bytes_received - 1;
		st->flags |= F_EOF_PENDING;
		if (st->bytes_seen >= st->eof_at &&
		    !(st->flags & (F_EOF_SENT | F_RESET_SENT | F_FAILED)))
			push_marker(st, BGS_ROUTE_EOF);
	} else if (new == BPF_TCP_FIN_WAIT1 || new == BPF_TCP_LAST_ACK) {
		st->flags |= F_SERVER_CLOSED;
	} else if (new == BPF_TCP_CLOSE) {
		if (!(st->flags & (F_EOF_SENT | F_RESET_SENT | F_SERVER_CLOSED)))
			push_marker(st, BGS_ROUTE_RESET);
		if (st->flags & F_RESET_PENDING) {
			/* Still no room: the cookie stays in failed_conns for userspace. */
		}
		bpf_map_delete_elem(&conn_states, &cookie);
		cnt_add(C_CONN_CLOSED, 1);
	}
}

SEC("sockops")
int bgs_sockops(struct bpf_sock_ops *ops)
{
	if (ops->family != AF_INET && ops->family != AF_INET6)
		return 1;
	if (ops->local_port != cfg_port)
		return 1;
	switch (ops->op) {
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		conn_open(ops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		conn_state_change(ops);
		break;
	default:
		break;
	}
	return 1;
}
