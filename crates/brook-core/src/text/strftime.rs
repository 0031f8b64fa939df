//! `strftime_now(format)` for chat templates (Llama-style templates print today's date).
//!
//! transformers calls `datetime.now().strftime(format)` in local time; brook has no time-zone
//! database, so this formats UTC. It supports the C89 specifiers templates use; an unknown one
//! is copied through as Python does on glibc. It must not read the environment or locale.

use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Civil {
    pub year: i64,
    pub month: u32, // 1..=12
    pub day: u32,   // 1..=31
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub weekday: u32, // 0 = Monday
    pub yday: u32,    // 1..=366
}

impl Civil {
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
        let yday = before + day + u32::from(leap && month > 2);
        Self {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            weekday: (days + 3).rem_euclid(7) as u32, // 1970-01-01 was a Thursday
            yday,
        }
    }
}

/// `datetime.now(UTC).strftime(format)`.
pub(crate) fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&Civil::from_unix(secs), format)
}

pub(crate) fn strftime(t: &Civil, format: &str) -> String {
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let day_name = DAYS[t.weekday as usize % 7];
        let month_name = MONTHS[(t.month as usize + 11) % 12];
        let hour12 = if t.hour.is_multiple_of(12) {
            12
        } else {
            t.hour % 12
        };
        match spec {
            'Y' => out.push_str(&t.year.to_string()),
            'y' => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            'm' => out.push_str(&format!("{:02}", t.month)),
            'd' => out.push_str(&format!("{:02}", t.day)),
            'e' => out.push_str(&format!("{:2}", t.day)),
            'H' => out.push_str(&format!("{:02}", t.hour)),
            'I' => out.push_str(&format!("{hour12:02}")),
            'M' => out.push_str(&format!("{:02}", t.minute)),
            'S' => out.push_str(&format!("{:02}", t.second)),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'j' => out.push_str(&format!("{:03}", t.yday)),
            'A' => out.push_str(day_name),
            'a' => out.push_str(&day_name[..3]),
            'B' => out.push_str(month_name),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'w' => out.push_str(&((t.weekday + 1) % 7).to_string()),
            'u' => out.push_str(&(t.weekday + 1).to_string()),
            'F' => out.push_str(&format!("{}-{:02}-{:02}", t.year, t.month, t.day)),
            'T' => out.push_str(&format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second)),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_a_known_instant() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = Civil::from_unix(1_709_211_909);
        assert_eq!(
            strftime(&t, "%d %b %Y %A %H:%M:%S %j %I%p %%"),
            "29 Feb 2024 Thursday 13:05:09 060 01PM %"
        );
        assert_eq!(strftime(&Civil::from_unix(0), "%F %a"), "1970-01-01 Thu");
    }
}
