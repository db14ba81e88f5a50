-- wrk script for bench/proxy_bench.sh: every request is a keep-alive POST of the same ~2 KiB
-- OpenAI chat-completions body (the shape an LLM load balancer forwards), and the run ends with
-- one machine-readable line that the benchmark parses instead of wrk's human summary.
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench-0000000000000000"
wrk.body = [==[
{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a careful senior site reliability engineer. Answer precisely, cite the commands you would run, and keep the answer short unless asked for detail. Prefer plain language over jargon."},{"role":"user","content":"Our inference fleet runs eight replicas of the same model behind a load balancer. Since yesterday the p99 time to first token went from 400 ms to 2.5 s while the request rate stayed flat at about 120 requests per second. GPU utilisation is uneven: two replicas sit near 95 percent while the others idle around 40 percent. The prefix cache hit rate reported by the replicas dropped from 70 percent to 35 percent at the same time. We deployed a new system prompt for the agent workload (about 3,000 tokens, shared by every conversation) and changed the tokenizer configuration to add a chat template revision. No other change went out. Here is an excerpt of the balancer log around the start of the incident:\n12:00:01 route conv=7f3a replica=r2 prefix_hit=0.12 queue=14\n12:00:01 route conv=91bc replica=r2 prefix_hit=0.10 queue=15\n12:00:02 route conv=0d44 replica=r5 prefix_hit=0.09 queue=13\n12:00:02 route conv=e1f0 replica=r2 prefix_hit=0.11 queue=16\n12:00:03 route conv=5a27 replica=r2 prefix_hit=0.13 queue=17\n12:00:03 route conv=c8d9 replica=r7 prefix_hit=0.08 queue=12\nWhat are the most likely causes, in order, and what would you check first to confirm each one?"},{"role":"assistant","content":"The pattern points at routing rather than capacity: the shared prefix changed, so cached blocks from the old prompt no longer match, and the balancer keeps sending new conversations to the replicas that hold the few matching blocks. Check the per-replica queue depth and the prefix hit rate side by side."},{"role":"user","content":"Queue depth on r2 is 16 and on the others 2 to 4. How do we spread the load without losing the cache?"}],"max_tokens":256,"temperature":0.2,"top_p":0.95,"stream":false,"user":"bench-client-0001","seed":1234}
]==]
-- A long bracket drops only the first newline after `[==[`: drop the last one too.
wrk.body = wrk.body:gsub("\n$", "")

-- latency values are in microseconds.
done = function(summary, latency, requests)
    local e = summary.errors
    io.write(string.format(
        "BENCH requests=%d duration_us=%d bytes=%d p50_us=%.0f p90_us=%.0f p99_us=%.0f "
            .. "mean_us=%.1f max_us=%.0f err_connect=%d err_read=%d err_write=%d "
            .. "err_status=%d err_timeout=%d\n",
        summary.requests, summary.duration, summary.bytes,
        latency:percentile(50), latency:percentile(90), latency:percentile(99),
        latency.mean, latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
