//! The `foldhost` binary: parses the command line and reports errors as one line with exit code 1.

use clap::Parser;

fn main() {
    let cli = foldhost::cli::Cli::parse();
    if let Err(e) = foldhost_core::crashpoint::check_env() {
        eprintln!("foldhost: error: {e}");
        std::process::exit(2);
    }
    // The documented targets (`foldhost`, `foldhost::MODULE`) reach the crates the modules live in.
    let filter = std::env::var("FOLDHOST_LOG")
        .ok()
        .and_then(|spec| {
            tracing_subscriber::EnvFilter::try_new(foldhost::cli::log_filter(&spec)).ok()
        })
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info,async_nats=warn"));
    let lines = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let format = foldhost::cli::log_format_of(&cli);
    match format {
        // Fields at the top level (`event` among them); the fold in `spans`; the `target` tells
        // the host's lines (`foldhost…`) from a library's.
        foldhost::cli::LogFormat::Json => lines
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .init(),
        // Colour only on a terminal: logs captured to a file or a pipe stay plain text.
        foldhost::cli::LogFormat::Text => lines
            .with_target(false)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    foldhost::cli::set_log_format(format);
    tracing::debug!(pid = std::process::id(), "process started");
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("foldhost: error: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = match rt.block_on(foldhost::cli::run(cli)) {
        Ok(()) => 0,
        Err(e) => foldhost::cli::report_error(&e),
    };
    // Don't wait for detached tasks (a signal listener, a status reporter) to notice.
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    std::process::exit(code);
}
