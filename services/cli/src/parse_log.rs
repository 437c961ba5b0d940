//! `gpumedic parse-log`: a kernel log through the collector's own parser, one JSON object per
//! GPU health event.

use std::process::ExitCode;

/// `gpumedic parse-log`: streams lines through the collector's kernel-log parser.
pub(crate) fn run(file: Option<&std::path::Path>) -> ExitCode {
    use std::io::{BufRead as _, Write as _};

    let input: Box<dyn std::io::BufRead> = match file {
        Some(path) => match std::fs::File::open(path) {
            Ok(f) => Box::new(std::io::BufReader::new(f)),
            Err(e) => {
                eprintln!("gpumedic parse-log: cannot read {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        },
        None => Box::new(std::io::stdin().lock()),
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut parser = gpumedic_collector::kernel_log::LogParser::new();
    let mut events = Vec::new();
    // Lines are read as bytes: a kernel log may hold invalid UTF-8, which must not stop the scan.
    let mut buf = Vec::new();
    let mut reader = input;
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                parser.feed(line.trim_end_matches(['\n', '\r']), &mut events);
                if let Err(e) = write_events(&mut out, &mut events) {
                    eprintln!("gpumedic parse-log: cannot write: {e}");
                    return ExitCode::FAILURE;
                }
            }
            Err(e) => {
                eprintln!("gpumedic parse-log: read failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    parser.flush(&mut events);
    match write_events(&mut out, &mut events).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumedic parse-log: cannot write: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write_events(
    out: &mut impl std::io::Write,
    events: &mut Vec<gpumedic_collector::kernel_log::KernelEvent>,
) -> std::io::Result<()> {
    for event in events.drain(..) {
        serde_json::to_writer(&mut *out, &event)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}
