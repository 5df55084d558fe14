//! The registry's REST API, for the two calls a reader needs:
//! `GET /schemas/ids/{id}` and, for references,
//! `GET /subjects/{subject}/versions/{version}`.
//!
//! Every answer is classified once, here:
//!
//! | Answer | Meaning |
//! |---|---|
//! | 200 with a schema | the schema |
//! | 404 with `error_code` 40403 (schema), 40401 (subject) or 40402 (version) | [`Fetch::NotFound`]: the id or a reference does not exist; the payload is malformed |
//! | 401, 403 | [`Fetch::Unavailable`] ([`InfraFault::Permission`]): wrong or missing credentials |
//! | 408, 429, 5xx | [`Fetch::Unavailable`] ([`InfraFault::Resources`], or [`InfraFault::Unreachable`] for 502/503/504) |
//! | no answer in time | [`Fetch::Unavailable`] ([`InfraFault::Timeout`]) |
//! | no connection (refused, reset, DNS, TLS) | [`Fetch::Unavailable`] ([`InfraFault::Unreachable`]) |
//! | anything else (another 404, a 200 that is not a schema, a redirect) | [`Fetch::Unavailable`] ([`InfraFault::Corrupt`]): not a registry answer, probably a wrong URL |
//!
//! Every URL is asked in turn until one gives the schema. "Not found" is
//! the registry's word only once every URL has said it: while one of them
//! is unavailable it may be the one that has the schema (a replica behind
//! its primary), so the delivery waits. References are looked up with
//! `deleted=true`, as Confluent's serializers do: a referenced version
//! that was soft-deleted still reads the records written with it.

use std::collections::HashSet;
use std::time::Duration;

use reqwest::{StatusCode, Url};
use serde::Deserialize;

use crate::store::InfraFault;

/// How many references a schema may bring in, all levels together.
const MAX_REFERENCES: usize = 256;

/// The largest answer read: a schema is text of a few kilobytes, so a
/// bigger answer is not a registry's.
const MAX_ANSWER_BYTES: usize = 8 << 20;

/// A schema as the registry serves it.
#[derive(Debug, Deserialize)]
pub(crate) struct Answer {
    pub(crate) schema: String,
    /// `AVRO` when absent, `PROTOBUF` or `JSON`.
    #[serde(rename = "schemaType", default)]
    pub(crate) schema_type: Option<String>,
    #[serde(default)]
    pub(crate) references: Vec<Reference>,
}

/// A schema's reference to another subject's version.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq, Hash)]
pub(crate) struct Reference {
    /// The Avro full name or the Protobuf import path.
    pub(crate) name: String,
    pub(crate) subject: String,
    pub(crate) version: i64,
}

/// Why a schema could not be fetched.
#[derive(Debug)]
pub(crate) enum Fetch {
    /// The registry says the schema (or a reference) does not exist.
    NotFound(String),
    /// No registry gave an answer to go by.
    Unavailable(InfraFault, String),
}

/// How to reach the registry.
pub(crate) struct Client {
    pub(crate) http: reqwest::Client,
    pub(crate) urls: Vec<Url>,
    pub(crate) basic_auth: Option<(String, String)>,
}

impl Client {
    /// The schema with id `id`, and its references' texts (dependencies
    /// first), each with the name it is referenced by.
    pub(crate) async fn schema(&self, id: u32) -> Result<(Answer, Vec<(String, String)>), Fetch> {
        let answer = self.get(&["schemas", "ids", &id.to_string()], None).await?;
        // JSON Schema payloads are read as JSON: their references are not needed.
        let references = if answer.schema_type.as_deref() == Some("JSON") {
            Vec::new()
        } else {
            self.references(&answer.references).await?
        };
        Ok((answer, references))
    }

    /// The references' texts, depth first so that dependencies come
    /// before what needs them, each subject version once.
    async fn references(&self, direct: &[Reference]) -> Result<Vec<(String, String)>, Fetch> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        // (reference, whether its own references were pushed already)
        let mut stack: Vec<(Reference, Option<String>)> =
            direct.iter().rev().map(|r| (r.clone(), None)).collect();
        while let Some((reference, text)) = stack.pop() {
            if let Some(text) = text {
                out.push((reference.name, text));
                continue;
            }
            if !seen.insert((reference.subject.clone(), reference.version)) {
                continue;
            }
            if seen.len() > MAX_REFERENCES {
                return Err(Fetch::NotFound(format!(
                    "the schema brings in more than {MAX_REFERENCES} references"
                )));
            }
            let version = reference.version.to_string();
            let answer = self
                .get(
                    &["subjects", &reference.subject, "versions", &version],
                    Some("deleted=true"),
                )
                .await?;
            stack.push((reference, Some(answer.schema)));
            stack.extend(answer.references.into_iter().rev().map(|r| (r, None)));
        }
        Ok(out)
    }

    /// `GET` of `segments` (and `query`) under each URL in turn.
    async fn get(&self, segments: &[&str], query: Option<&str>) -> Result<Answer, Fetch> {
        let mut unavailable = None;
        let mut not_found = None;
        for base in &self.urls {
            let mut url = base.clone();
            if let Ok(mut path) = url.path_segments_mut() {
                path.pop_if_empty().extend(segments);
            }
            url.set_query(query);
            match self.get_one(url).await {
                Ok(answer) => return Ok(answer),
                Err(Fetch::NotFound(why)) => not_found = Some(why),
                Err(fetch @ Fetch::Unavailable(..)) => unavailable = Some(fetch),
            }
        }
        Err(match (unavailable, not_found) {
            (Some(unavailable), _) => unavailable,
            (None, Some(why)) => Fetch::NotFound(why),
            (None, None) => {
                Fetch::Unavailable(InfraFault::Unreachable, "no registry URL".to_owned())
            }
        })
    }

    async fn get_one(&self, url: Url) -> Result<Answer, Fetch> {
        let shown = redacted(&url);
        let mut request = self.http.get(url).header(
            "accept",
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        if let Some((user, password)) = &self.basic_auth {
            request = request.basic_auth(user, Some(password));
        }
        let unavailable = |fault, why: String| Fetch::Unavailable(fault, format!("{shown}: {why}"));
        // No answer in time, or no connection.
        let unanswered = |e: reqwest::Error| {
            let fault = if e.is_timeout() {
                InfraFault::Timeout
            } else {
                InfraFault::Unreachable
            };
            unavailable(fault, error_chain(&e))
        };
        let mut response = request.send().await.map_err(unanswered)?;
        let status = response.status();
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(unanswered)? {
            if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(unavailable(
                    InfraFault::Corrupt,
                    format!("an answer over {MAX_ANSWER_BYTES} bytes is not a registry's"),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        if status == StatusCode::OK {
            return serde_json::from_slice(&body).map_err(|e| {
                unavailable(
                    InfraFault::Corrupt,
                    format!("not a schema registry answer: {e}"),
                )
            });
        }
        let said = said(&body);
        let fault = match status.as_u16() {
            404 => {
                if let Some((code @ (40401..=40403), message)) = said {
                    return Err(Fetch::NotFound(format!(
                        "the schema registry has no such schema: {message} (error {code})"
                    )));
                }
                InfraFault::Corrupt
            }
            401 | 403 => InfraFault::Permission,
            502..=504 => InfraFault::Unreachable,
            408 | 429 | 500..=599 => InfraFault::Resources,
            _ => InfraFault::Corrupt,
        };
        let message = said.map(|(_, m)| m).unwrap_or_default();
        Err(unavailable(fault, format!("HTTP {status} {message}")))
    }
}

/// The registry's `{"error_code": .., "message": ..}`, if it said one.
fn said(body: &[u8]) -> Option<(i64, String)> {
    #[derive(Deserialize)]
    struct Said {
        error_code: i64,
        #[serde(default)]
        message: String,
    }
    serde_json::from_slice::<Said>(body)
        .ok()
        .map(|s| (s.error_code, s.message))
}

/// `url` without credentials, for errors and logs.
pub(crate) fn redacted(url: &Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.to_string()
}

/// An error and its sources, `a: b: c`, as reqwest hides the cause
/// (refused, reset, certificate) in its sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The default time a registry call may take, connection included.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
