//! Maintenance windows: when actions that are not urgent may disrupt workloads. Pure: parsing,
//! "is a window open at t", "when does the next one open", and which verdicts may wait.
//!
//! A window is written `<days> <start>-<end>` in UTC, such as `Sat 02:00-06:00`,
//! `Mon-Fri 22:00-02:00` (crossing midnight: it starts on the named day), `daily 03:00:00-03:30:00`
//! or `* 01:00-02:00`; a trailing `UTC` is accepted. Seconds are allowed so tests can open a
//! window a few seconds ahead.
//!
//! Urgency: a critical verdict is always urgent. A warning or info verdict whose action drains
//! the node (drain, GPU reset, reboot, replace, contact support) is deferrable: outside every
//! window the node is only marked (its condition set, no cordon, no taint) and the rest waits for
//! the next window. Cordon and monitor requests are cheap for workloads and are never deferred.

use std::time::Duration;

use chrono::{DateTime, Datelike, NaiveTime, TimeDelta, Timelike, Utc, Weekday};

use crate::request::Action;

/// One recurring maintenance window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// The days it starts on, Monday first.
    days: [bool; 7],
    /// Seconds after midnight UTC it opens.
    start: u32,
    /// How long it stays open.
    length: Duration,
    /// As written, for logs and the actions topic.
    text: String,
}

const DAYS: [(&str, Weekday); 7] = [
    ("mon", Weekday::Mon),
    ("tue", Weekday::Tue),
    ("wed", Weekday::Wed),
    ("thu", Weekday::Thu),
    ("fri", Weekday::Fri),
    ("sat", Weekday::Sat),
    ("sun", Weekday::Sun),
];

fn day(name: &str) -> Result<usize, String> {
    let lower = name.trim().to_ascii_lowercase();
    // `Sat`, `sat` and `Saturday` all name Saturday.
    DAYS.iter()
        .position(|(d, _)| lower.len() >= 3 && lower.is_char_boundary(3) && *d == &lower[..3])
        .ok_or_else(|| format!("'{name}' is not a day (Mon..Sun)"))
}

fn time_of_day(raw: &str) -> Result<u32, String> {
    let t = NaiveTime::parse_from_str(raw, "%H:%M:%S")
        .or_else(|_| NaiveTime::parse_from_str(raw, "%H:%M"))
        .map_err(|_| format!("'{raw}' is not a time of day (HH:MM or HH:MM:SS)"))?;
    Ok(t.num_seconds_from_midnight())
}

impl std::str::FromStr for Window {
    type Err = String;

    fn from_str(raw: &str) -> Result<Self, String> {
        let mut words: Vec<&str> = raw.split_whitespace().collect();
        if words.last().is_some_and(|w| w.eq_ignore_ascii_case("utc")) {
            words.pop();
        }
        let [days_word, span] = words[..] else {
            return Err(format!("'{raw}' is not a window: write '<days> HH:MM-HH:MM', such as 'Sat 02:00-06:00 UTC'"));
        };
        let mut days = [false; 7];
        if days_word == "*" || days_word.eq_ignore_ascii_case("daily") {
            days = [true; 7];
        } else {
            for part in days_word.split(',') {
                match part.split_once('-') {
                    Some((from, to)) => {
                        let (from, to) = (day(from)?, day(to)?);
                        let mut d = from;
                        loop {
                            days[d] = true;
                            if d == to {
                                break;
                            }
                            d = (d + 1) % 7;
                        }
                    }
                    None => days[day(part)?] = true,
                }
            }
        }
        let (from, to) = span.split_once('-').ok_or_else(|| format!("'{span}' is not a span: write HH:MM-HH:MM"))?;
        let (start, end) = (time_of_day(from)?, time_of_day(to)?);
        if start == end {
            return Err(format!("'{raw}' opens and closes at the same time"));
        }
        let secs = if end > start { end - start } else { 86_400 - start + end };
        Ok(Window { days, start, length: Duration::from_secs(u64::from(secs)), text: raw.trim().to_owned() })
    }
}

impl std::fmt::Display for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl Window {
    /// The openings of this window that start from one day before `now` to a week after, as
    /// (opens, closes).
    fn openings(&self, now: DateTime<Utc>) -> impl Iterator<Item = (DateTime<Utc>, DateTime<Utc>)> + '_ {
        let midnight = now.date_naive().and_hms_opt(0, 0, 0).expect("midnight exists").and_utc();
        (-1..=7).filter_map(move |offset| {
            let day = midnight + TimeDelta::days(offset);
            let weekday = day.weekday().num_days_from_monday() as usize;
            self.days[weekday].then(|| {
                let opens = day + TimeDelta::seconds(i64::from(self.start));
                (opens, opens + TimeDelta::from_std(self.length).expect("a window is shorter than a day"))
            })
        })
    }
}

/// Whether any window is open at `now`.
pub fn open_at(windows: &[Window], now: DateTime<Utc>) -> bool {
    windows.iter().any(|w| w.openings(now).any(|(opens, closes)| opens <= now && now < closes))
}

/// When the next window opens after `now`; `now` itself when one is open. `None` without windows.
pub fn next_opening(windows: &[Window], now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    if open_at(windows, now) {
        return Some(now);
    }
    windows.iter().flat_map(|w| w.openings(now)).map(|(opens, _)| opens).filter(|o| *o > now).min()
}

/// Whether a verdict of this urgency and action may wait for a window (see the module docs).
pub fn deferrable(critical: bool, action: Action) -> bool {
    !critical && action.drains()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn w(s: &str) -> Window {
        s.parse().unwrap()
    }

    #[test]
    fn parses_days_ranges_and_times() {
        assert!("Sat 02:00-06:00 UTC".parse::<Window>().is_ok());
        assert!("Mon-Fri 22:00-02:00".parse::<Window>().is_ok());
        assert!("daily 03:00:00-03:00:30".parse::<Window>().is_ok());
        assert!("Saturday,Sun 01:00-02:00".parse::<Window>().is_ok());
        for bad in ["", "Sat", "Sat 02:00", "Sat 25:00-26:00", "Xyz 01:00-02:00", "Sat 01:00-01:00", "Sat 1-2 3"] {
            assert!(bad.parse::<Window>().is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn open_and_next_opening() {
        // 2026-01-03 is a Saturday.
        let sat = [w("Sat 02:00-06:00 UTC")];
        assert!(open_at(&sat, at("2026-01-03T02:00:00Z")));
        assert!(open_at(&sat, at("2026-01-03T05:59:59Z")));
        assert!(!open_at(&sat, at("2026-01-03T06:00:00Z")));
        assert!(!open_at(&sat, at("2026-01-02T03:00:00Z")));
        assert_eq!(next_opening(&sat, at("2026-01-03T04:00:00Z")), Some(at("2026-01-03T04:00:00Z")));
        assert_eq!(next_opening(&sat, at("2026-01-03T07:00:00Z")), Some(at("2026-01-10T02:00:00Z")));
        assert_eq!(next_opening(&sat, at("2026-01-01T00:00:00Z")), Some(at("2026-01-03T02:00:00Z")));
        assert_eq!(next_opening(&[], at("2026-01-01T00:00:00Z")), None);
    }

    #[test]
    fn a_window_crossing_midnight_belongs_to_the_day_it_starts() {
        let nights = [w("Fri 22:00-02:00")];
        assert!(open_at(&nights, at("2026-01-02T23:00:00Z"))); // Friday night
        assert!(open_at(&nights, at("2026-01-03T01:30:00Z"))); // Saturday early morning
        assert!(!open_at(&nights, at("2026-01-03T22:30:00Z"))); // Saturday night
        let weekdays = [w("Mon-Fri 22:00-02:00")];
        assert!(!open_at(&weekdays, at("2026-01-05T01:00:00Z")), "Sunday night is not in Mon-Fri");
        assert!(open_at(&weekdays, at("2026-01-06T01:00:00Z")), "Monday's window runs into Tuesday");
    }

    #[test]
    fn the_earliest_of_several_windows_wins() {
        let ws = [w("Sun 01:00-02:00"), w("daily 12:00:00-12:00:10")];
        assert_eq!(next_opening(&ws, at("2026-01-03T12:00:10Z")), Some(at("2026-01-04T01:00:00Z")));
        assert_eq!(next_opening(&ws, at("2026-01-03T11:00:00Z")), Some(at("2026-01-03T12:00:00Z")));
    }

    #[test]
    fn only_non_critical_disruptive_actions_wait() {
        assert!(deferrable(false, Action::Drain));
        assert!(deferrable(false, Action::RebootNode));
        assert!(!deferrable(true, Action::RebootNode));
        assert!(!deferrable(false, Action::Cordon));
        assert!(!deferrable(false, Action::Monitor));
    }
}
