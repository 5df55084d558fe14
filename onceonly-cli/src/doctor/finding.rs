//! One result of a doctor check, and the report they make.

use crate::out;

/// How a check went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// As expected.
    Ok,
    /// Works now, but will bite (retention shorter than a broker's, dead
    /// outbox rows, a skewed clock).
    Warn,
    /// Broken: deliveries wait, fail or could run twice.
    Fail,
}

/// What one check found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Finding {
    /// The check, e.g. `privileges`.
    pub check: &'static str,
    /// How it went.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// How to fix it, when it is not ok.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    /// A check that passed.
    pub fn ok(check: &'static str, detail: impl Into<String>) -> Self {
        Self {
            check,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    /// A warning, with its fix.
    pub fn warn(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            check,
            status: Status::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    /// A failure, with its fix.
    pub fn fail(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            check,
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// The exit status of a report: 0 all ok, 3 warnings only, 1 a failure.
pub fn exit_code(findings: &[Finding]) -> u8 {
    match findings.iter().map(|f| f.status).max() {
        Some(Status::Fail) => 1,
        Some(Status::Warn) => 3,
        _ => 0,
    }
}

/// Prints the findings, one per line, fixes indented below.
pub fn print(findings: &[Finding]) {
    for f in findings {
        let mark = match f.status {
            Status::Ok => "ok  ",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        out!("{mark}  {:<12}  {}", f.check, f.detail);
        if let Some(fix) = &f.fix {
            out!("      {:<12}  fix: {fix}", "");
        }
    }
    let failed = findings.iter().filter(|f| f.status == Status::Fail).count();
    let warned = findings.iter().filter(|f| f.status == Status::Warn).count();
    out!("{failed} problem(s), {warned} warning(s)");
}
