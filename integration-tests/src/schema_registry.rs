//! A loopback schema registry speaking the two calls of the Confluent
//! Schema Registry REST API a reader makes, and the fixtures it serves.
//!
//! [`Registry::start`] binds `127.0.0.1:0` and serves, with axum in a
//! spawned task until dropped, at the root and under Apicurio's
//! compatibility prefix `/apis/ccompat/v7`:
//!
//! | Request | Answer |
//! |---|---|
//! | `GET /schemas/ids/{id}`, id known | 200 `{"schema": .., "schemaType": .., "references": [..]}` (`schemaType` absent for Avro, as Confluent answers) |
//! | `GET /schemas/ids/{id}`, id unknown | 404 `{"error_code": 40403, "message": "Schema {id} not found"}` |
//! | `GET /subjects/{subject}/versions/{version}`, known | 200 `{"subject", "version", "id", "schema", "schemaType", "references"}` |
//! | ... subject unknown | 404 `{"error_code": 40401, ..}`; version unknown, or [soft-deleted](Registry::soft_delete) without `?deleted=true`: 40402 |
//! | any request while [down](Registry::set_down) | 503 `{"error_code": 50003, ..}` |
//! | any request without the [required](Registry::require_basic_auth) basic credentials | 401 `{"error_code": 401, ..}` |
//! | anything else | 404 with a plain-text body |
//!
//! The fixtures (`fixtures/schema_registry/fixtures.json`) were written by
//! `make.py` there with Python's `fastavro` and Google's `protobuf`: an
//! encoder independent of the decoder under test.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use serde_json::{Value, json};

const FIXTURES: &str = include_str!("../fixtures/schema_registry/fixtures.json");

/// The fixture file: schemas by id, subjects' versions, payloads.
pub struct Fixtures {
    all: Value,
}

impl Fixtures {
    /// The committed fixtures.
    pub fn load() -> Self {
        Self {
            all: serde_json::from_str(FIXTURES).expect("fixtures.json"),
        }
    }

    /// Every payload's name.
    pub fn names(&self) -> Vec<String> {
        self.payloads()
            .map(|p| p["name"].as_str().unwrap().to_owned())
            .collect()
    }

    fn payloads(&self) -> impl Iterator<Item = &Value> {
        self.all["payloads"].as_array().unwrap().iter()
    }

    fn payload_entry(&self, name: &str) -> &Value {
        self.payloads()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no fixture payload {name}"))
    }

    /// The wire bytes of payload `name`.
    pub fn payload(&self, name: &str) -> Vec<u8> {
        hex_decode(self.payload_entry(name)["hex"].as_str().unwrap())
    }

    /// The value tree payload `name` decodes to; `None` for a payload that
    /// must be refused.
    pub fn expected(&self, name: &str) -> Option<Value> {
        Some(self.payload_entry(name)["expected"].clone()).filter(|v| !v.is_null())
    }

    fn schemas(&self) -> HashMap<u32, Value> {
        self.all["schemas"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(id, s)| (id.parse().unwrap(), s.clone()))
            .collect()
    }

    fn subjects(&self) -> HashMap<(String, i64), u32> {
        let mut out = HashMap::new();
        for (subject, versions) in self.all["subjects"].as_object().unwrap() {
            for (version, id) in versions.as_object().unwrap() {
                out.insert(
                    (subject.clone(), version.parse().unwrap()),
                    id.as_u64().unwrap() as u32,
                );
            }
        }
        out
    }
}

fn hex_decode(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[derive(Default)]
struct Shared {
    schemas: HashMap<u32, Value>,
    subjects: HashMap<(String, i64), u32>,
    down: bool,
    basic_auth: Option<String>,
    soft_deleted: Vec<(String, i64)>,
    requests: Vec<String>,
}

/// The loopback registry; stops on drop.
pub struct Registry {
    port: u16,
    shared: Arc<Mutex<Shared>>,
    task: tokio::task::JoinHandle<()>,
}

impl Registry {
    /// Serves the committed fixtures' schemas.
    pub async fn start() -> Self {
        let fixtures = Fixtures::load();
        let shared = Arc::new(Mutex::new(Shared {
            schemas: fixtures.schemas(),
            subjects: fixtures.subjects(),
            ..Shared::default()
        }));
        let api = Router::new()
            .route("/schemas/ids/{id}", get(by_id))
            .route("/subjects/{subject}/versions/{version}", get(by_version));
        let app = Router::new()
            .nest("/apis/ccompat/v7", api.clone())
            .merge(api)
            .fallback(|| async { (StatusCode::NOT_FOUND, "no such page") })
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { port, shared, task }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:<port>`, for a TLS proxy in front.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// While `down`, every request is answered 503.
    pub fn set_down(&self, down: bool) {
        self.shared.lock().unwrap().down = down;
    }

    /// Requires HTTP basic credentials `user:password` on every request.
    pub fn require_basic_auth(&self, user: &str, password: &str) {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        self.shared.lock().unwrap().basic_auth = Some(format!("Basic {token}"));
    }

    /// Soft-deletes `subject`'s `version`: served only to requests with
    /// `?deleted=true`, as Confluent's registry does.
    pub fn soft_delete(&self, subject: &str, version: i64) {
        self.shared
            .lock()
            .unwrap()
            .soft_deleted
            .push((subject.to_owned(), version));
    }

    /// Forgets schema `id` (a registry that never had it).
    pub fn forget(&self, id: u32) {
        self.shared.lock().unwrap().schemas.remove(&id);
    }

    /// The paths requested so far, in order, answered or not.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().unwrap().requests.clone()
    }

    /// How many requests asked for schema `id`.
    pub fn fetches_of(&self, id: u32) -> usize {
        let suffix = format!("/schemas/ids/{id}");
        self.requests()
            .iter()
            .filter(|p| p.ends_with(&suffix))
            .count()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type SharedState = Arc<Mutex<Shared>>;

/// The refusal every route gives first, if any: down, or credentials.
fn refusal(shared: &SharedState, headers: &HeaderMap, path: String) -> Option<Response> {
    let mut s = shared.lock().unwrap();
    s.requests.push(path);
    if s.down {
        return Some(error(StatusCode::SERVICE_UNAVAILABLE, 50003, "unavailable"));
    }
    if let Some(expected) = &s.basic_auth {
        let given = headers.get("authorization").and_then(|v| v.to_str().ok());
        if given != Some(expected.as_str()) {
            return Some(error(StatusCode::UNAUTHORIZED, 401, "Unauthorized"));
        }
    }
    None
}

fn error(status: StatusCode, code: i64, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error_code": code, "message": message})),
    )
        .into_response()
}

fn schema_answer(schema: &Value) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    out.insert("schema".into(), schema["schema"].clone());
    if let Some(t) = schema.get("schemaType") {
        out.insert("schemaType".into(), t.clone());
    }
    out.insert(
        "references".into(),
        schema.get("references").cloned().unwrap_or(json!([])),
    );
    out
}

async fn by_id(
    State(shared): State<SharedState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = refusal(&shared, &headers, format!("/schemas/ids/{id}")) {
        return refused;
    }
    let s = shared.lock().unwrap();
    match id.parse::<u32>().ok().and_then(|id| s.schemas.get(&id)) {
        Some(schema) => axum::Json(Value::Object(schema_answer(schema))).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            40403,
            &format!("Schema {id} not found"),
        ),
    }
}

async fn by_version(
    State(shared): State<SharedState>,
    headers: HeaderMap,
    Path((subject, version)): Path<(String, String)>,
    uri: Uri,
) -> Response {
    let path = format!("/subjects/{subject}/versions/{version}");
    if let Some(refused) = refusal(&shared, &headers, path) {
        return refused;
    }
    let s = shared.lock().unwrap();
    if !s.subjects.keys().any(|(name, _)| *name == subject) {
        return error(
            StatusCode::NOT_FOUND,
            40401,
            &format!("Subject '{subject}' not found."),
        );
    }
    let deleted = uri
        .query()
        .is_some_and(|q| q.split('&').any(|pair| pair == "deleted=true"));
    let found = version
        .parse::<i64>()
        .ok()
        .filter(|v| deleted || !s.soft_deleted.contains(&(subject.clone(), *v)))
        .and_then(|v| s.subjects.get(&(subject.clone(), v)))
        .and_then(|id| Some((*id, s.schemas.get(id)?)));
    match found {
        Some((id, schema)) => {
            let mut answer = schema_answer(schema);
            answer.insert("subject".into(), json!(subject));
            answer.insert("version".into(), json!(version.parse::<i64>().unwrap_or(0)));
            answer.insert("id".into(), json!(id));
            axum::Json(Value::Object(answer)).into_response()
        }
        None => error(
            StatusCode::NOT_FOUND,
            40402,
            &format!("Version {version} not found."),
        ),
    }
}
