#![forbid(unsafe_code)]

#[global_allocator]
static GLOBAL: kvlb::alloc::CountingMiMalloc = kvlb::alloc::CountingMiMalloc;

const USAGE: &str = "usage: kvlb <command> [options]

commands:
  serve     run the load balancer
  replica   run simulated GPU replicas (vLLM interfaces)
  demo      a simulated fleet, kvlb in front, traffic replayed, policies compared
  simulate  replay a request trace through simulated replicas, policies compared
  replay    send a request trace through a balancer, live, and measure TTFT

`kvlb <command> --help` lists a command's options.";

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprintln!("{USAGE}");
        std::process::exit(2);
    }
    let cmd = args.remove(0);
    let code = match cmd.as_str() {
        "serve" => kvlb::serve::main(args),
        "replica" => kvlb::replica::main(args),
        "demo" => kvlb::demo::main(args),
        "simulate" => kvlb::sim::main(args),
        "replay" => kvlb::replay::main(args),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            0
        }
        other => {
            eprintln!("kvlb: unknown command {other:?}\n\n{USAGE}");
            2
        }
    };
    std::process::exit(code);
}
