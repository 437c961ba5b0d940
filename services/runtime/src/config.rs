//! Configuration: flags and environment variables shared by every service, and validation that
//! lists every problem at once.
//!
//! Services declare their flags with clap (each with an `env = "GPUMEDIC_..."`) and implement
//! [`Validate`], which turns the raw flags into a typed config or a list of [`Problem`]s.
//! [`load_or_exit`] prints all of them and exits with [`EXIT_CONFIG`] (64, `EX_CONFIG` in sysexits)
//! so an operator fixes a broken config in one round, not one problem per restart.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use clap::error::ErrorKind;

/// The exit status of a service whose configuration is invalid (sysexits' `EX_USAGE`).
pub const EXIT_CONFIG: u8 = 64;

/// One thing wrong with a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The flag or file field at fault, as the operator writes it (`--admin-addr`).
    pub field: String,
    /// What is wrong, in a sentence.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Collects problems while a configuration is validated.
#[derive(Debug, Default)]
pub struct Problems(Vec<Problem>);

impl Problems {
    /// Records a problem with `field`.
    pub fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem { field: field.into(), message: message.into() });
    }

    /// Keeps the value of `result`, or records its error against `field` and returns `None`.
    pub fn check<T>(&mut self, field: &str, result: Result<T, String>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(message) => {
                self.push(field, message);
                None
            }
        }
    }

    /// Adds every problem of `other`.
    pub fn extend(&mut self, other: Problems) {
        self.0.extend(other.0);
    }

    /// True when nothing is wrong.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The problems found so far.
    pub fn list(&self) -> &[Problem] {
        &self.0
    }

    /// `Ok(value)` when there are no problems. `value` is produced only then, so it may unwrap the
    /// `Option`s returned by [`Problems::check`].
    pub fn finish<T>(self, value: impl FnOnce() -> T) -> Result<T, Problems> {
        if self.0.is_empty() { Ok(value()) } else { Err(self) }
    }
}

/// Turns raw flags into a validated configuration, listing every problem.
pub trait Validate {
    /// The validated configuration.
    type Valid;
    /// Checks everything; returns all problems found, not just the first.
    fn validate(self) -> Result<Self::Valid, Problems>;
}

/// Parses the command line and environment, validates, and returns the configuration. On any
/// problem, prints them all to stderr and exits with status 64; `--help` and `--version` exit 0.
pub fn load_or_exit<C: Parser + Validate>(program: &str) -> C::Valid {
    match load_from::<C, _, _>(program, std::env::args_os()) {
        Ok(valid) => valid,
        Err(LoadError::Display(text)) => {
            print!("{text}");
            std::process::exit(0);
        }
        Err(LoadError::Invalid(text)) => {
            eprint!("{text}");
            std::process::exit(i32::from(EXIT_CONFIG));
        }
    }
}

/// Why [`load_from`] did not return a configuration.
#[derive(Debug)]
pub enum LoadError {
    /// Help or version text was asked for; print it and exit 0.
    Display(String),
    /// The configuration is invalid; the text lists every problem.
    Invalid(String),
}

/// [`load_or_exit`] without the exit: parses `args` (the first being the program name).
pub fn load_from<C, I, T>(program: &str, args: I) -> Result<C::Valid, LoadError>
where
    C: Parser + Validate,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let raw = C::try_parse_from(args).map_err(|e| match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            LoadError::Display(e.render().to_string())
        }
        _ => LoadError::Invalid(format!("{program}: invalid configuration\n{}", e.render())),
    })?;
    raw.validate().map_err(|problems| LoadError::Invalid(render_problems(program, &problems)))
}

/// Formats problems the way services print them at start.
pub fn render_problems(program: &str, problems: &Problems) -> String {
    let mut out = format!(
        "{program}: invalid configuration ({} problem{}):\n",
        problems.list().len(),
        if problems.list().len() == 1 { "" } else { "s" }
    );
    for p in problems.list() {
        out.push_str(&format!("  - {p}\n"));
    }
    out
}

/// Parses a duration written as a number and a unit: `250ms`, `10s`, `5m`, `2h`, `1d`.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (digits, unit) = raw.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("'{raw}' is not a duration; write a number and a unit, such as 500ms, 10s, 5m, 2h"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => return Err(format!("'{raw}' has no known unit; use ms, s, m, h or d")),
    };
    Ok(d)
}

/// Parses `host:port` into a socket address.
pub fn parse_socket_addr(raw: &str) -> Result<SocketAddr, String> {
    raw.parse().map_err(|_| format!("'{raw}' is not an address of the form IP:PORT, such as 0.0.0.0:9400"))
}

/// Flags every service shares: logging, tracing, the admin server and shutdown.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Address of the admin HTTP server that serves /healthz, /readyz and /metrics.
    #[arg(long, env = "GPUMEDIC_ADMIN_ADDR", default_value = "0.0.0.0:9400")]
    pub admin_addr: String,

    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, env = "GPUMEDIC_LOG_FORMAT", default_value = "text")]
    pub log_format: String,

    /// Log filter in tracing's EnvFilter syntax, for example `info,gpumedic_classifier=debug`.
    #[arg(long, env = "GPUMEDIC_LOG", default_value = "info")]
    pub log: String,

    /// OTLP/gRPC endpoint that receives traces, for example `http://otel-collector:4317`. Tracing
    /// export is off when unset.
    #[arg(long, env = "GPUMEDIC_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// How long a graceful shutdown may take before the process exits anyway. Keep it below the
    /// pod's termination grace period.
    #[arg(long, env = "GPUMEDIC_SHUTDOWN_DEADLINE", default_value = "20s")]
    pub shutdown_deadline: String,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// [`CommonArgs`] validated.
#[derive(Debug, Clone)]
pub struct CommonConfig {
    /// Where the admin server listens.
    pub admin_addr: SocketAddr,
    /// How logs are written.
    pub log_format: LogFormat,
    /// The tracing filter directive.
    pub log: String,
    /// Where traces go, if anywhere.
    pub otlp_endpoint: Option<String>,
    /// The shutdown deadline.
    pub shutdown_deadline: Duration,
}

impl Validate for CommonArgs {
    type Valid = CommonConfig;

    fn validate(self) -> Result<CommonConfig, Problems> {
        let mut p = Problems::default();
        let admin_addr = p.check("--admin-addr", parse_socket_addr(&self.admin_addr));
        let log_format = p.check(
            "--log-format",
            match self.log_format.as_str() {
                "text" => Ok(LogFormat::Text),
                "json" => Ok(LogFormat::Json),
                other => Err(format!("'{other}' is not a log format; use text or json")),
            },
        );
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log) {
            p.push("--log", format!("'{}' is not a valid filter: {e}", self.log));
        }
        if let Some(ep) = &self.otlp_endpoint
            && !(ep.starts_with("http://") || ep.starts_with("https://"))
        {
            p.push("--otlp-endpoint", format!("'{ep}' must start with http:// or https://"));
        }
        let shutdown_deadline = p.check("--shutdown-deadline", parse_duration(&self.shutdown_deadline));
        p.finish(|| CommonConfig {
            admin_addr: admin_addr.expect("checked"),
            log_format: log_format.expect("checked"),
            log: self.log,
            otlp_endpoint: self.otlp_endpoint,
            shutdown_deadline: shutdown_deadline.expect("checked"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Parser)]
    struct Args {
        #[command(flatten)]
        common: CommonArgs,
    }

    impl Validate for Args {
        type Valid = CommonConfig;
        fn validate(self) -> Result<CommonConfig, Problems> {
            self.common.validate()
        }
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("ten seconds").is_err());
        assert!(parse_duration("5y").is_err());
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        let err = load_from::<Args, _, _>(
            "svc",
            ["svc", "--admin-addr", "nowhere", "--log-format", "xml", "--shutdown-deadline", "soon"],
        )
        .expect_err("three bad values");
        let LoadError::Invalid(text) = err else { panic!("expected Invalid, got {err:?}") };
        assert!(text.contains("3 problems"), "{text}");
        assert!(text.contains("--admin-addr: 'nowhere'"), "{text}");
        assert!(text.contains("--log-format: 'xml'"), "{text}");
        assert!(text.contains("--shutdown-deadline: 'soon'"), "{text}");
    }

    #[test]
    fn unknown_flag_is_invalid_not_help() {
        let err = load_from::<Args, _, _>("svc", ["svc", "--no-such-flag"]).expect_err("unknown flag");
        assert!(matches!(err, LoadError::Invalid(ref t) if t.contains("--no-such-flag")), "{err:?}");
    }

    #[test]
    fn defaults_are_valid() {
        let c = load_from::<Args, _, _>("svc", ["svc"]).expect("defaults valid");
        assert_eq!(c.admin_addr.port(), 9400);
        assert_eq!(c.log_format, LogFormat::Text);
        assert_eq!(c.shutdown_deadline, Duration::from_secs(20));
    }
}
