// SPDX-License-Identifier: GPL-2.0
/* kvlb's L4 sockmap forwarding: once kvlb has read and routed the first request of a client
 * connection, it puts the client socket and the replica socket in kvlb_socks and names each
 * one's peer in kvlb_peers. From then on every buffer received on either socket is handed by
 * this stream verdict program to the other socket's send path inside the kernel.
 *
 * Attached as a stream verdict without a stream parser, so the kernel runs it on whole
 * receive-queue buffers (no strparser framing). What the kernel does not do, kvlb does in user
 * space: bytes queued before a socket entered the map, and FIN (see src/l4/sockmap.rs). */

#include "include/kvlb_bpf.h"
#include "include/kvlb_maps.h"

_Static_assert(sizeof(struct kvlb_sock_key) == 8, "kvlb_sock_key is 8 bytes");
_Static_assert(sizeof(struct kvlb_peer) == 24, "kvlb_peer is 24 bytes");

/* The joined sockets, by cookie. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, KVLB_MAX_SOCKETS);
	__type(key, struct kvlb_sock_key);
	__type(value, __u32);
} kvlb_socks SEC(".maps");

/* Each joined socket's peer and byte count, by cookie. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, KVLB_MAX_SOCKETS);
	__type(key, struct kvlb_sock_key);
	__type(value, struct kvlb_peer);
} kvlb_peers SEC(".maps");

SEC("sk_skb/stream_verdict")
int kvlb_verdict(struct __sk_buff *skb)
{
	struct kvlb_sock_key key = { .cookie = bpf_get_socket_cookie(skb) };
	struct kvlb_peer *p = bpf_map_lookup_elem(&kvlb_peers, &key);

	/* Not (or no longer) joined: leave the bytes to the socket's own reader. */
	if (!p)
		return SK_PASS;
	/* A FIN comes as a buffer without data. Redirected, the kernel would try to send zero
	 * bytes on the peer, take that for a broken pipe and fail the peer (EPIPE). kvlb passes
	 * FIN on itself (shutdown), so the empty buffer is dropped here. */
	if (skb->len == 0)
		return SK_DROP;
	__sync_fetch_and_add(&p->redirected_bytes, skb->len);
	__sync_fetch_and_add(&p->redirected_skbs, 1);
	return bpf_sk_redirect_hash(skb, &kvlb_socks, &p->peer, 0);
}

char _license[] SEC("license") = "GPL";
