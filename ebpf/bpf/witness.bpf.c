// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
//
// Custody's eBPF witness: uprobes on the KV transport's probe points (runtime/src/transport/abi.rs,
// "the probe ABI") and on libibverbs' control path. Every observation is a fixed-layout record
// (`struct event`, mirrored by `ebpf/src/event.rs`) in one ring buffer — or, for the requests of
// a post without SGE lists, an entry (`struct wr_entry`) of a batch record that shares one
// `struct event` header among up to POST_BATCH_WRS requests.
//
// No program keeps state in a per-CPU map across helper calls: a uprobe program runs with
// migration disabled but can be preempted, and another hit on the same CPU would share it.
//
// Invariants:
// - Knows the transport only through the probe ABI: the C layouts below are that contract's
//   (`ibv_sge`, `ibv_send_wr`, `ibv_wc`, with the offsets tabled in abi.rs).
// - Every loop is bounded (a work-request chain by MAX_CHAIN and a completion batch by
//   MAX_WC_BATCH through bpf_loop, scatter/gather lists by MAX_SGE);
//   whatever a bound cuts off is counted in `lost`, never dropped silently.
// - A record the ring buffer cannot take is counted per CPU in `lost` (LOST_RING_FULL).
// - Wake-ups are batched: a record is submitted with BPF_RB_NO_WAKEUP unless its reservation
//   took the unread data across a multiple of the threshold the loader sets in `config` — one
//   wake-up per threshold's worth of records, not one per record above the threshold (each is
//   an irq_work self-interrupt, and a collector that has not been scheduled yet would otherwise
//   be re-woken by every record). The collector also polls on a timer, so a quiet tail is read
//   within its poll interval.
//
// Built by ebpf/build.rs: clang -O2 -g -target bpf -D__TARGET_ARCH_x86 (-g: the maps need BTF).

#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// Bounds. A page's chain is a few writes when the page is full and, when it is not, one per
// contiguous chunk (layer x K/V x KV head) plus the header: 181 for the embedded model.
#define MAX_CHAIN 4096
// Completions decoded per announced batch (the transport's abi::COMPLETE_BATCH_MAX).
#define MAX_WC_BATCH 256
// Scatter/gather entries decoded per work request (the transport's MAX_SGE is 30).
#define MAX_SGE 30

enum kind {
	EV_POST_WRITE = 1,
	EV_COMPLETE = 2,
	EV_REGISTER = 3,
	EV_INVALIDATE = 4,
	EV_IBV_REG_MR = 5,
	EV_IBV_DEREG_MR = 6,
	EV_IBV_CREATE_QP = 7,
	EV_IBV_MODIFY_QP = 8,
	EV_IBV_DESTROY_QP = 9,
	EV_POST_BATCH = 10, // a run of a posted chain's work requests: header + wr_entry[n]
};

// `lost` counter indices (per CPU).
enum lost_idx {
	LOST_RING_FULL = 0,       // a record the ring buffer had no room for
	LOST_CHAIN_TRUNCATED = 1, // work requests past MAX_CHAIN in one post, or completions past
	                          // MAX_WC_BATCH in one batch
	LOST_SGE_TRUNCATED = 2,   // scatter/gather entries past MAX_SGE in one request
	LOST_READ_FAULT = 3,      // user memory that could not be read
	LOST_PENDING_FULL = 4,    // a uretprobe's entry arguments had no slot
	LOST_N = 5,
};

// Record flags.
#define F_READ_FAULT 1u
#define F_SGE_TRUNCATED 2u
#define F_NO_ENTRY 4u

struct sge {
	__u64 addr;
	__u32 length;
	__u32 lkey;
};

// struct ibv_send_wr, the part the probe ABI defines (offsets in abi.rs).
struct send_wr_head {
	__u64 wr_id;
	__u64 next;
	__u64 sg_list;
	__s32 num_sge;
	__u32 opcode;
	__u32 send_flags;
	__u32 imm_data;
	__u64 remote_addr;
	__u32 rkey;
	__u32 pad;
};

// struct ibv_wc.
struct wc {
	__u64 wr_id;
	__u32 status;
	__u32 opcode;
	__u32 vendor_err;
	__u32 byte_len;
	__u32 imm_data;
	__u32 qp_num;
	__u32 src_qp;
	__u32 wc_flags;
	__u16 pkey_index;
	__u16 slid;
	__u8 sl;
	__u8 dlid_path_bits;
	__u8 reserved[2];
};
_Static_assert(sizeof(struct wc) == 48, "struct ibv_wc is 48 bytes (the array stride)");

// libibverbs' public structs (infiniband/verbs.h), the members read here.
struct ibv_mr_head {
	__u64 context;
	__u64 pd;
	__u64 addr;
	__u64 length;
	__u32 handle;
	__u32 lkey;
	__u32 rkey;
};
struct ibv_qp_head {
	__u64 context;
	__u64 qp_context;
	__u64 pd;
	__u64 send_cq;
	__u64 recv_cq;
	__u64 srq;
	__u32 handle;
	__u32 qp_num;
	__u32 state;
	__u32 qp_type;
};

// One observation. The header (everything before `sges`) is what non-write records carry.
struct event {
	__u64 ktime_ns;    // bpf_ktime_get_ns (CLOCK_MONOTONIC)
	__u32 pid;         // tgid
	__u32 tid;
	__u32 kind;        // enum kind
	__u32 flags;       // F_*
	__u64 ctx;         // transport ctx; ibv: pd / qp / mr pointer
	__u64 wr_id;
	__u64 addr;        // remote address (write); region address (register, reg_mr)
	__u64 bytes;       // sum of SGE lengths (write); byte_len (completion); region length
	__u32 rkey;
	__u32 lkey;
	__u32 opcode;      // wr opcode / wc opcode
	__u32 send_flags;  // send flags; ibv: access flags / attr mask
	__u32 imm_be;      // immediate data as in memory (network order)
	__s32 status;      // wc status; ibv: return value; modify_qp: target state
	__u32 num_sge;     // as posted (may exceed MAX_SGE: see F_SGE_TRUNCATED)
	__u32 chain_index; // position of this work request in its chain
	__u32 qp_num;
	__u32 cpu;
	struct sge sges[MAX_SGE];
};

#define HEAD_BYTES __builtin_offsetof(struct event, sges)

// One work request in an EV_POST_BATCH record (without SGE lists, the default): the header's
// ktime_ns, pid, tid, ctx and cpu are the post's; `chain_index` is the first entry's position in
// its chain and `num_sge` the record's entry count. One record per POST_BATCH_WRS requests
// instead of one per request: a post of a 16-page transfer (48 requests) is 6 ring-buffer
// writes, not 48 reservations, wake-up checks and commits.
struct wr_entry {
	__u64 wr_id;
	__u64 remote_addr;
	__u64 bytes;       // sum of the decoded SGE lengths
	__u32 rkey;
	__u32 opcode;
	__u32 send_flags;
	__u32 imm_be;
	__u32 num_sge;     // as posted
	__u32 flags;       // F_*
};
_Static_assert(sizeof(struct wr_entry) == 48, "wr_entry is 48 bytes (ebpf/src/event.rs)");
// Entries per batch record: reserved whole, so a short post wastes the unused entries' ring
// space (a 3-request post: 240 of 480 bytes) — the bound trades that against reservations.
#define POST_BATCH_WRS 8
struct post_batch {
	__u8 head[HEAD_BYTES];
	struct wr_entry wrs[POST_BATCH_WRS];
};
// SGEs read per probe read when only their lengths are summed (on the stack: 240 bytes; a
// full request of MAX_SGE entries is two reads).
#define SGE_CHUNK 15

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22); // 4 MiB; the loader may resize
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, LOST_N);
	__type(key, __u32);
	__type(value, __u64);
} lost SEC(".maps");

// config[0]: wake the reader once this many bytes are unread (0: wake on every record).
// config[1]: non-zero to carry each write's scatter/gather entries in its record (one 576-byte
//            record per request); zero to carry only their count and total length (batch
//            records: 48 bytes per request).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} config SEC(".maps");

// Entry arguments of a call whose uretprobe completes the record, by thread. Bounded: a thread is
// in at most one such call at a time; a full table is counted (LOST_PENDING_FULL).
struct pending {
	__u64 a0, a1, a2, a3;
	__u32 kind;
	__u32 pad;
};
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct pending);
} pending SEC(".maps");

static __always_inline void count_lost(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&lost, &idx);
	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline __u64 wake_flags(__u64 size)
{
	__u32 k = 0;
	__u64 *threshold = bpf_map_lookup_elem(&config, &k);
	__u64 t = threshold ? *threshold : 0;
	if (t == 0)
		return 0;
	// `avail` counts this record (reserved, with its 8-byte header) and any reserved since on
	// other CPUs. Wake on the record that takes the unread data across the threshold, and again
	// at each further threshold's worth while the collector has not caught up (a collector busy
	// when the first wake-up came, or not yet scheduled, is not left to its timer while the
	// ring fills): one wake-up per `t` bytes of records, not one per record. The window is two
	// records wide so that a concurrent reservation rarely hides a crossing.
	__u64 avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	__u64 window = 2 * (size + 8);
	return avail >= t && avail % t < window ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

static __always_inline struct event *reserve_head(__u32 kind)
{
	struct event *e = bpf_ringbuf_reserve(&events, HEAD_BYTES, 0);
	if (!e) {
		count_lost(LOST_RING_FULL);
		return 0;
	}
	__builtin_memset(e, 0, HEAD_BYTES);
	__u64 id = bpf_get_current_pid_tgid();
	e->ktime_ns = bpf_ktime_get_ns();
	e->pid = id >> 32;
	e->tid = (__u32)id;
	e->kind = kind;
	e->cpu = bpf_get_smp_processor_id();
	return e;
}

static __always_inline void submit_head(struct event *e)
{
	bpf_ringbuf_submit(e, wake_flags(HEAD_BYTES));
}

// State of one chain walk (bpf_loop callback context).
struct chain_walk {
	__u64 wr;   // next work request to decode (0: the chain ended)
	__u64 ctx;
	__u64 id;   // pid_tgid
	__u64 now;
	__u32 cpu;
	__u32 stop; // set when the walk ended early (read fault)
	__u32 pad;
};

// One work request of a chain, with its SGE entries (`record_sges`): one record.
static long post_one(__u32 i, void *data)
{
	struct chain_walk *c = data;
	struct send_wr_head h;
	if (!c->wr)
		return 1;
	if (bpf_probe_read_user(&h, sizeof(h), (void *)c->wr)) {
		count_lost(LOST_READ_FAULT);
		c->stop = 1;
		return 1;
	}
	__u32 n = h.num_sge < 0 ? 0 : (__u32)h.num_sge;
	__u32 take = n > MAX_SGE ? MAX_SGE : n;
	// The size is re-bounded after an optimisation barrier: otherwise clang passes the
	// unbounded register and the verifier refuses the read.
	__u64 size = (__u64)take * sizeof(struct sge);
	asm volatile("" : "+r"(size));
	if (size > MAX_SGE * sizeof(struct sge))
		size = MAX_SGE * sizeof(struct sge);
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(struct event), 0);
	if (!e) {
		count_lost(LOST_RING_FULL);
		c->wr = h.next;
		return 0;
	}
	struct sge *sg = e->sges;
	e->ktime_ns = c->now;
	e->pid = c->id >> 32;
	e->tid = (__u32)c->id;
	e->kind = EV_POST_WRITE;
	e->flags = 0;
	e->ctx = c->ctx;
	e->wr_id = h.wr_id;
	e->addr = h.remote_addr;
	e->rkey = h.rkey;
	e->lkey = 0;
	e->opcode = h.opcode;
	e->send_flags = h.send_flags;
	e->imm_be = h.imm_data;
	e->status = 0;
	e->num_sge = n;
	e->chain_index = i;
	e->qp_num = 0;
	e->cpu = c->cpu;
	if (n > MAX_SGE) {
		e->flags |= F_SGE_TRUNCATED;
		count_lost(LOST_SGE_TRUNCATED);
	}
	__u64 total = 0;
	if (size > 0 && bpf_probe_read_user(sg, size, (void *)h.sg_list)) {
		e->flags |= F_READ_FAULT;
		count_lost(LOST_READ_FAULT);
	} else {
		__u32 j;
#pragma clang loop unroll(disable)
		for (j = 0; j < MAX_SGE; j++) {
			if (j >= take)
				break;
			total += sg[j].length;
		}
	}
	e->bytes = total;
	// Entries past `take` are not read: zero them so no stale ring memory is reported.
	__u32 j;
#pragma clang loop unroll(disable)
	for (j = 0; j < MAX_SGE; j++) {
		if (j >= take) {
			sg[j].addr = 0;
			sg[j].length = 0;
			sg[j].lkey = 0;
		}
	}
	bpf_ringbuf_submit(e, wake_flags(sizeof(struct event)));
	c->wr = h.next;
	return 0;
}

// Sum of the lengths of `n` SGEs at `list`, read SGE_CHUNK at a time onto the stack (no shared
// scratch: a uprobe program can be preempted, and another hit on the same CPU would clobber a
// per-CPU buffer mid-use). Returns -1 when the memory cannot be read.
static __always_inline __s64 sge_bytes(__u64 list, __u32 n)
{
	struct sge chunk[SGE_CHUNK];
	__u64 total = 0;
	__u32 done = 0;
#pragma clang loop unroll(disable)
	for (int r = 0; r < (MAX_SGE + SGE_CHUNK - 1) / SGE_CHUNK; r++) {
		if (done >= n)
			break;
		__u32 take = n - done;
		if (take > SGE_CHUNK)
			take = SGE_CHUNK;
		__u64 size = (__u64)take * sizeof(struct sge);
		asm volatile("" : "+r"(size));
		if (size > sizeof(chunk))
			size = sizeof(chunk);
		if (size == 0)
			break;
		if (bpf_probe_read_user(chunk, size, (void *)(list + (__u64)done * sizeof(struct sge))))
			return -1;
#pragma clang loop unroll(disable)
		for (int j = 0; j < SGE_CHUNK; j++) {
			if (j >= take)
				break;
			total += chunk[j].length;
		}
		done += take;
	}
	return (__s64)total;
}

// State of one batched chain walk (bpf_loop callback context).
struct batch_walk {
	__u64 wr;   // next work request to decode (0: the chain ended)
	__u64 ctx;
	__u64 id;   // pid_tgid
	__u64 now;
	__u32 cpu;
	__u32 index; // chain position of the next request
	__u32 stop;  // set when the walk ended early (read fault)
	__u32 pad;
};

// Up to POST_BATCH_WRS requests of the chain: one EV_POST_BATCH record.
static long post_batch_one(__u32 i, void *data)
{
	struct batch_walk *c = data;
	if (!c->wr)
		return 1;
	struct post_batch *b = bpf_ringbuf_reserve(&events, sizeof(struct post_batch), 0);
	if (!b) {
		// The chain's remaining requests are not walked: one count for the record lost.
		count_lost(LOST_RING_FULL);
		c->stop = 1;
		return 1;
	}
	struct event *e = (struct event *)b->head;
	__builtin_memset(e, 0, HEAD_BYTES);
	e->ktime_ns = c->now;
	e->pid = c->id >> 32;
	e->tid = (__u32)c->id;
	e->kind = EV_POST_BATCH;
	e->ctx = c->ctx;
	e->cpu = c->cpu;
	e->chain_index = c->index;
	__u32 n = 0;
#pragma clang loop unroll(disable)
	for (int k = 0; k < POST_BATCH_WRS; k++) {
		struct send_wr_head h;
		if (!c->wr)
			break;
		if (bpf_probe_read_user(&h, sizeof(h), (void *)c->wr)) {
			count_lost(LOST_READ_FAULT);
			c->stop = 1;
			c->wr = 0;
			break;
		}
		struct wr_entry *w = &b->wrs[k];
		__u32 ns = h.num_sge < 0 ? 0 : (__u32)h.num_sge;
		w->wr_id = h.wr_id;
		w->remote_addr = h.remote_addr;
		w->rkey = h.rkey;
		w->opcode = h.opcode;
		w->send_flags = h.send_flags;
		w->imm_be = h.imm_data;
		w->num_sge = ns;
		w->flags = 0;
		if (ns > MAX_SGE) {
			w->flags |= F_SGE_TRUNCATED;
			count_lost(LOST_SGE_TRUNCATED);
			ns = MAX_SGE;
		}
		__s64 total = sge_bytes(h.sg_list, ns);
		if (total < 0) {
			w->flags |= F_READ_FAULT;
			count_lost(LOST_READ_FAULT);
			total = 0;
		}
		w->bytes = (__u64)total;
		n++;
		c->index++;
		c->wr = h.next;
	}
	if (n == 0) {
		bpf_ringbuf_discard(b, BPF_RB_NO_WAKEUP);
		return 1;
	}
	e->num_sge = n;
	bpf_ringbuf_submit(b, wake_flags(sizeof(struct post_batch)));
	return c->wr ? 0 : 1;
}

// custody_kv_post_write(ctx: u64, wr: *const SendWr): the work-request chain walked with bpf_loop
// (a chain of a partially filled page is one request per layer and head: hundreds for larger
// models, and a post links several pages; bpf_loop keeps the verifier's cost independent of the
// bound) into batch records of POST_BATCH_WRS requests, or, with `record_sges`, one record per
// request carrying its SGE entries.
SEC("uprobe")
int custody_post_write(struct pt_regs *regs)
{
	struct chain_walk c = {
		.wr = PT_REGS_PARM2(regs),
		.ctx = PT_REGS_PARM1(regs),
		.id = bpf_get_current_pid_tgid(),
		.now = bpf_ktime_get_ns(),
		.cpu = bpf_get_smp_processor_id(),
		.stop = 0,
	};
	__u32 k = 1;
	__u64 *with_sges = bpf_map_lookup_elem(&config, &k);
	if (with_sges && *with_sges) {
		bpf_loop(MAX_CHAIN, post_one, &c, 0);
		if (c.wr && !c.stop)
			count_lost(LOST_CHAIN_TRUNCATED);
		return 0;
	}
	// Without SGE lists: batch records (EV_POST_BATCH) of up to POST_BATCH_WRS requests.
	struct batch_walk bw = {
		.wr = c.wr, .ctx = c.ctx, .id = c.id, .now = c.now, .cpu = c.cpu,
		.index = 0, .stop = 0,
	};
	bpf_loop(MAX_CHAIN / POST_BATCH_WRS, post_batch_one, &bw, 0);
	if (bw.wr && !bw.stop)
		count_lost(LOST_CHAIN_TRUNCATED);
	return 0;
}

// State of one completion-batch walk (bpf_loop callback context).
struct wc_walk {
	__u64 wcs;  // the array
	__u64 ctx;
	__u32 n;    // entries in the array
	__u32 stop; // set when a read failed or the ring buffer was full
};

static long complete_one(__u64 i, void *data)
{
	struct wc_walk *c = data;
	struct wc w;
	if (i >= c->n)
		return 1;
	if (bpf_probe_read_user(&w, sizeof(w), (void *)(c->wcs + i * sizeof(struct wc)))) {
		count_lost(LOST_READ_FAULT);
		c->stop = 1;
		return 1;
	}
	struct event *e = reserve_head(EV_COMPLETE);
	if (!e) {
		c->stop = 1;
		return 1;
	}
	e->ctx = c->ctx;
	e->wr_id = w.wr_id;
	e->status = (__s32)w.status;
	e->opcode = w.opcode;
	e->bytes = w.byte_len;
	e->imm_be = w.imm_data;
	e->qp_num = w.qp_num;
	e->chain_index = (__u32)i;
	submit_head(e);
	return 0;
}

// custody_kv_complete(ctx: u64, wcs: *const Wc, n: u32): a batch of completions, as one poll of
// a completion queue returns them; one record each. Entries past MAX_WC_BATCH are counted lost
// (the transport announces at most that many per call).
SEC("uprobe")
int custody_complete(struct pt_regs *regs)
{
	struct wc_walk c = {
		.wcs = PT_REGS_PARM2(regs),
		.ctx = PT_REGS_PARM1(regs),
		.n = (__u32)PT_REGS_PARM3(regs),
		.stop = 0,
	};
	bpf_loop(MAX_WC_BATCH, complete_one, &c, 0);
	if (c.n > MAX_WC_BATCH && !c.stop)
		count_lost(LOST_CHAIN_TRUNCATED);
	return 0;
}

// custody_kv_register(ctx: u64, rkey: u32, addr: u64, len: u64).
SEC("uprobe")
int custody_register(struct pt_regs *regs)
{
	struct event *e = reserve_head(EV_REGISTER);
	if (!e)
		return 0;
	e->ctx = PT_REGS_PARM1(regs);
	e->rkey = (__u32)PT_REGS_PARM2(regs);
	e->addr = PT_REGS_PARM3(regs);
	e->bytes = PT_REGS_PARM4(regs);
	submit_head(e);
	return 0;
}

// custody_kv_invalidate(ctx: u64, rkey: u32).
SEC("uprobe")
int custody_invalidate(struct pt_regs *regs)
{
	struct event *e = reserve_head(EV_INVALIDATE);
	if (!e)
		return 0;
	e->ctx = PT_REGS_PARM1(regs);
	e->rkey = (__u32)PT_REGS_PARM2(regs);
	submit_head(e);
	return 0;
}

// ---- libibverbs control path -------------------------------------------------------------------

static __always_inline void stash(__u32 kind, __u64 a0, __u64 a1, __u64 a2, __u64 a3)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct pending p = {.a0 = a0, .a1 = a1, .a2 = a2, .a3 = a3, .kind = kind};
	if (bpf_map_update_elem(&pending, &tid, &p, BPF_ANY))
		count_lost(LOST_PENDING_FULL);
}

// Takes this thread's stashed arguments of `kind` (zeroes and F_NO_ENTRY if there are none).
static __always_inline __u32 unstash(__u32 kind, struct pending *out)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct pending *p = bpf_map_lookup_elem(&pending, &tid);
	if (!p || p->kind != kind) {
		__builtin_memset(out, 0, sizeof(*out));
		return F_NO_ENTRY;
	}
	*out = *p;
	bpf_map_delete_elem(&pending, &tid);
	return 0;
}

// ibv_reg_mr(pd, addr, length, access) -> struct ibv_mr *
SEC("uprobe")
int ibv_reg_mr_entry(struct pt_regs *regs)
{
	stash(EV_IBV_REG_MR, PT_REGS_PARM1(regs), PT_REGS_PARM2(regs), PT_REGS_PARM3(regs),
	      PT_REGS_PARM4(regs));
	return 0;
}

SEC("uretprobe")
int ibv_reg_mr_return(struct pt_regs *regs)
{
	struct pending p;
	__u32 flags = unstash(EV_IBV_REG_MR, &p);
	__u64 mr = PT_REGS_RC(regs);
	struct event *e = reserve_head(EV_IBV_REG_MR);
	if (!e)
		return 0;
	e->flags = flags;
	e->ctx = mr;
	e->addr = p.a1;
	e->bytes = p.a2;
	e->send_flags = (__u32)p.a3;
	e->status = mr ? 0 : -1;
	if (mr) {
		struct ibv_mr_head h;
		if (bpf_probe_read_user(&h, sizeof(h), (void *)mr)) {
			e->flags |= F_READ_FAULT;
			count_lost(LOST_READ_FAULT);
		} else {
			e->lkey = h.lkey;
			e->rkey = h.rkey;
		}
	}
	submit_head(e);
	return 0;
}

// ibv_dereg_mr(mr) -> int: the keys are read at entry (the struct is freed by the call).
SEC("uprobe")
int ibv_dereg_mr_entry(struct pt_regs *regs)
{
	__u64 mr = PT_REGS_PARM1(regs);
	struct ibv_mr_head h;
	__builtin_memset(&h, 0, sizeof(h));
	if (mr && bpf_probe_read_user(&h, sizeof(h), (void *)mr))
		count_lost(LOST_READ_FAULT);
	stash(EV_IBV_DEREG_MR, mr, h.addr, h.length, ((__u64)h.rkey << 32) | h.lkey);
	return 0;
}

SEC("uretprobe")
int ibv_dereg_mr_return(struct pt_regs *regs)
{
	struct pending p;
	__u32 flags = unstash(EV_IBV_DEREG_MR, &p);
	struct event *e = reserve_head(EV_IBV_DEREG_MR);
	if (!e)
		return 0;
	e->flags = flags;
	e->ctx = p.a0;
	e->addr = p.a1;
	e->bytes = p.a2;
	e->rkey = (__u32)(p.a3 >> 32);
	e->lkey = (__u32)p.a3;
	e->status = (__s32)PT_REGS_RC(regs);
	submit_head(e);
	return 0;
}

// ibv_create_qp(pd, attr) -> struct ibv_qp *
SEC("uretprobe")
int ibv_create_qp_return(struct pt_regs *regs)
{
	__u64 qp = PT_REGS_RC(regs);
	struct event *e = reserve_head(EV_IBV_CREATE_QP);
	if (!e)
		return 0;
	e->ctx = qp;
	e->status = qp ? 0 : -1;
	if (qp) {
		struct ibv_qp_head h;
		if (bpf_probe_read_user(&h, sizeof(h), (void *)qp)) {
			e->flags |= F_READ_FAULT;
			count_lost(LOST_READ_FAULT);
		} else {
			e->qp_num = h.qp_num;
			e->opcode = h.qp_type;
		}
	}
	submit_head(e);
	return 0;
}

// ibv_modify_qp(qp, attr, attr_mask): attr->qp_state is the struct's first member.
SEC("uprobe")
int ibv_modify_qp_entry(struct pt_regs *regs)
{
	__u64 qp = PT_REGS_PARM1(regs);
	__u32 state = 0;
	struct ibv_qp_head h;
	struct event *e = reserve_head(EV_IBV_MODIFY_QP);
	if (!e)
		return 0;
	e->ctx = qp;
	e->send_flags = (__u32)PT_REGS_PARM3(regs);
	if (bpf_probe_read_user(&state, sizeof(state), (void *)PT_REGS_PARM2(regs)) ||
	    bpf_probe_read_user(&h, sizeof(h), (void *)qp)) {
		e->flags |= F_READ_FAULT;
		count_lost(LOST_READ_FAULT);
	} else {
		e->qp_num = h.qp_num;
	}
	e->status = (__s32)state;
	submit_head(e);
	return 0;
}

// ibv_destroy_qp(qp).
SEC("uprobe")
int ibv_destroy_qp_entry(struct pt_regs *regs)
{
	__u64 qp = PT_REGS_PARM1(regs);
	struct ibv_qp_head h;
	struct event *e = reserve_head(EV_IBV_DESTROY_QP);
	if (!e)
		return 0;
	e->ctx = qp;
	if (bpf_probe_read_user(&h, sizeof(h), (void *)qp)) {
		e->flags |= F_READ_FAULT;
		count_lost(LOST_READ_FAULT);
	} else {
		e->qp_num = h.qp_num;
	}
	submit_head(e);
	return 0;
}
