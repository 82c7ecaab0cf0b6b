//! `backstop`: the operator's view of the step journal. See the library's docs for the
//! commands and their exit codes.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    std::process::ExitCode::from(runtime.block_on(backstop_cli::run(std::env::args_os())))
}
