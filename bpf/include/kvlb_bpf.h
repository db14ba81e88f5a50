/* The few BPF definitions the programs need, so that building them takes clang and the kernel's
 * UAPI headers (linux-libc-dev) only, not libbpf's headers. */
#ifndef KVLB_BPF_H
#define KVLB_BPF_H

#include <linux/bpf.h>

#define SEC(name) __attribute__((section(name), used))

/* BTF-defined maps, as libbpf and aya read them. */
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static __u64 (*bpf_get_socket_cookie)(void *ctx) = (void *)BPF_FUNC_get_socket_cookie;
static long (*bpf_sk_redirect_hash)(struct __sk_buff *skb, void *map, void *key,
				    __u64 flags) = (void *)BPF_FUNC_sk_redirect_hash;

#endif
