//! Input sanity: one place, before any rule, that refuses observations no real GPU or node can
//! produce. A refused observation is neither fault evidence nor healthy evidence; the engine
//! counts it by reason and the service logs it with its node.
//!
//! The bounds are physical, not tuning: a GPU's temperature sensor reads within about -40..150 °C,
//! its slowdown and shutdown thresholds are positive and below that ceiling, power is not negative
//! and not ten times the enforced limit, counters are not negative and the ones kept in the
//! InfoROM never go down on the same GPU.

use std::fmt;

use super::facts::{NodeFacts, PERSISTENT_COUNTERS};
use super::id::Id;
use super::observation::{FieldValue, Observation};

/// The coldest and hottest readings a GPU's sensor can report, in °C.
pub const TEMPERATURE_RANGE: (f64, f64) = (-40.0, 150.0);

/// How much later than its publication an observation may say it happened (clock skew between
/// the collector's sources and its publisher).
pub const FUTURE_SLACK_MICROS: i64 = 10 * 60 * 1_000_000;

/// Power above this many times the enforced limit is a broken reading, not a fault.
const POWER_LIMIT_FACTOR: f64 = 10.0;

/// Why an observation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invalid {
    /// A temperature outside what a sensor can read.
    Temperature,
    /// A slowdown or shutdown threshold at or below zero or above the sensor's range.
    Threshold,
    /// Negative power, or power far above the limit.
    Power,
    /// A number that is not finite.
    NotFinite,
    /// A counter below zero (a wrapped 64-bit value).
    NegativeCounter,
    /// A counter that persists across resets went down on the same GPU.
    CounterBackwards,
    /// Stamped long after it was published.
    FromTheFuture,
    /// A boot id this node has already left behind.
    OldBoot,
    /// A maintenance notice whose window is already over.
    WindowOver,
}

impl Invalid {
    /// Every reason, so the metric's series exist (at zero) before the first refusal.
    pub const ALL: [Invalid; 9] = [
        Invalid::Temperature,
        Invalid::Threshold,
        Invalid::Power,
        Invalid::NotFinite,
        Invalid::NegativeCounter,
        Invalid::CounterBackwards,
        Invalid::FromTheFuture,
        Invalid::OldBoot,
        Invalid::WindowOver,
    ];

    /// The metric label and log word.
    pub fn as_str(self) -> &'static str {
        match self {
            Invalid::Temperature => "temperature_out_of_range",
            Invalid::Threshold => "threshold_out_of_range",
            Invalid::Power => "power_out_of_range",
            Invalid::NotFinite => "not_finite",
            Invalid::NegativeCounter => "negative_counter",
            Invalid::CounterBackwards => "counter_backwards",
            Invalid::FromTheFuture => "from_the_future",
            Invalid::OldBoot => "old_boot_id",
            Invalid::WindowOver => "maintenance_window_over",
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn number(o: &Observation, field: &str) -> Option<f64> {
    o.fields.get(field).and_then(FieldValue::as_f64)
}

/// Checks `o` against physics and against what `facts` already know of its node.
pub fn check(o: &Observation, facts: &NodeFacts) -> Result<(), Invalid> {
    if o.fields.values().any(|v| matches!(v, FieldValue::Float(f) if !f.is_finite())) {
        return Err(Invalid::NotFinite);
    }
    if let Some(received) = o.received_at_micros
        && o.observed_at_micros > received.saturating_add(FUTURE_SLACK_MICROS)
    {
        return Err(Invalid::FromTheFuture);
    }
    if let Some(boot) = &o.boot_id
        && facts.is_old_boot(boot)
    {
        return Err(Invalid::OldBoot);
    }
    match o.kind.as_str() {
        "temperature" => {
            let (lo, hi) = TEMPERATURE_RANGE;
            if number(o, "value").is_some_and(|v| !(lo..=hi).contains(&v)) {
                return Err(Invalid::Temperature);
            }
            for field in ["slowdown_threshold", "shutdown_threshold"] {
                if number(o, field).is_some_and(|t| t <= 0.0 || t > hi) {
                    return Err(Invalid::Threshold);
                }
            }
        }
        "power" => {
            let value = number(o, "value");
            let limit = number(o, "limit");
            if value.is_some_and(|v| v < 0.0) || limit.is_some_and(|l| l <= 0.0) {
                return Err(Invalid::Power);
            }
            if let (Some(v), Some(l)) = (value, limit)
                && v > l * POWER_LIMIT_FACTOR
            {
                return Err(Invalid::Power);
            }
        }
        "cloud_maintenance"
            if !o.healthy && number(o, "ends_at_micros").is_some_and(|end| end < o.observed_at_micros as f64) =>
        {
            return Err(Invalid::WindowOver);
        }
        _ => {}
    }
    for (name, value) in &o.fields {
        let counter = matches!(
            name.as_str(),
            "single_bit_volatile"
                | "double_bit_volatile"
                | "single_bit_aggregate"
                | "double_bit_aggregate"
                | "total"
                | "correctable"
                | "uncorrectable"
                | "crc_errors"
                | "recovery_errors"
        ) || (o.kind == "pcie_replay" && name == "value");
        if counter && value.as_f64().is_some_and(|v| v < 0.0) {
            return Err(Invalid::NegativeCounter);
        }
    }
    if let Some(gpu) = &o.gpu {
        for (kind, field) in PERSISTENT_COUNTERS {
            if o.kind != *kind {
                continue;
            }
            let Some(FieldValue::Int(value)) = o.fields.get(*field) else { continue };
            if facts.counters.get(&Id::new(gpu), kind, field).is_some_and(|last| *value < last) {
                return Err(Invalid::CounterBackwards);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(value: i64, slowdown: i64, shutdown: i64) -> Observation {
        Observation::new("t", "n", 0, "temperature")
            .gpu("GPU-a")
            .field("value", value)
            .field("slowdown_threshold", slowdown)
            .field("shutdown_threshold", shutdown)
    }

    #[test]
    fn impossible_temperatures_and_thresholds_are_refused() {
        let f = NodeFacts::default();
        assert_eq!(check(&temp(70, 87, 92), &f), Ok(()));
        assert_eq!(check(&temp(2_147_483_647, 87, 92), &f), Err(Invalid::Temperature));
        assert_eq!(check(&temp(-273, 87, 92), &f), Err(Invalid::Temperature));
        assert_eq!(check(&temp(70, 87, -1), &f), Err(Invalid::Threshold));
        assert_eq!(check(&temp(70, 87, 0), &f), Err(Invalid::Threshold));
        assert_eq!(check(&temp(70, 87, 4000), &f), Err(Invalid::Threshold));
        let nan = Observation::new("t", "n", 0, "temperature").field("value", f64::NAN);
        assert_eq!(check(&nan, &f), Err(Invalid::NotFinite));
    }

    #[test]
    fn power_counters_time_boot_and_windows() {
        let mut f = NodeFacts::default();
        let power = |v: f64, l: f64| Observation::new("p", "n", 0, "power").field("value", v).field("limit", l);
        assert_eq!(check(&power(700.0, 700.0), &f), Ok(()));
        assert_eq!(check(&power(-1.0, 700.0), &f), Err(Invalid::Power));
        assert_eq!(check(&power(70_000.0, 700.0), &f), Err(Invalid::Power));
        let wrapped = Observation::new("e", "n", 0, "ecc").gpu("GPU-a").field("double_bit_aggregate", -5i64);
        assert_eq!(check(&wrapped, &f), Err(Invalid::NegativeCounter));
        let agg = |v: i64| Observation::new("e", "n", 0, "ecc").gpu("GPU-a").field("single_bit_aggregate", v);
        f.learn(&agg(100), 1);
        assert_eq!(check(&agg(100), &f), Ok(()));
        assert_eq!(check(&agg(99), &f), Err(Invalid::CounterBackwards));
        let mut late = Observation::new("x", "n", 3_600_000_000, "xid");
        late.received_at_micros = Some(0);
        assert_eq!(check(&late, &f), Err(Invalid::FromTheFuture));
        f.learn(&Observation::new("a", "n", 0, "monitor_health").boot("b1"), 1);
        f.learn(&Observation::new("b", "n", 0, "monitor_health").boot("b2"), 2);
        assert_eq!(check(&Observation::new("c", "n", 0, "monitor_health").boot("b1"), &f), Err(Invalid::OldBoot));
        let over = Observation::new("m", "n", 10, "cloud_maintenance").field("ends_at_micros", 5i64);
        assert_eq!(check(&over, &f), Err(Invalid::WindowOver));
    }
}
