/* The interface between kvlb and its sockmap program: the key and value structs of the two
 * maps, shared byte for byte with src/l4/sockmap.rs (a test compiles this header and compares
 * every size and offset with the Rust side). Padding is explicit so both compilers agree and
 * no uninitialised bytes reach a hash key. */
#ifndef KVLB_MAPS_H
#define KVLB_MAPS_H

#include <linux/types.h>

/* How many sockets (two per joined connection) the maps hold at most. */
#define KVLB_MAX_SOCKETS 65536

/* A socket, named by its kernel socket cookie (getsockopt SO_COOKIE; bpf_get_socket_cookie).
 * Key of both maps. */
struct kvlb_sock_key {
	__u64 cookie;
};

/* kvlb_peers value: where bytes received on the key's socket go, and what went there. */
struct kvlb_peer {
	struct kvlb_sock_key peer; /* the socket bytes are redirected to (its egress) */
	__u64 redirected_bytes;    /* bytes the program redirected from the key's socket */
	__u32 redirected_skbs;     /* buffers redirected */
	__u32 _pad;                /* explicit: keeps the struct 24 bytes with no hole */
};

#endif
