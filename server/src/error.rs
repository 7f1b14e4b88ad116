//! Errors as OpenAI's clients expect them: `{"error": {"message", "type", "param", "code"}}`
//! with the matching HTTP status. Every failure the server answers goes through [`ApiError`],
//! so that no path returns a plain-text or empty error body.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// One error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `rate_limit_error`,
    /// `server_error`, …
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<Box<str>>,
    /// `Retry-After` seconds (429 and 503).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code: None,
            param: None,
            retry_after_s: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            .code("invalid_api_key")
    }

    pub fn rate_limited(message: impl Into<String>, retry_after_s: u64) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .code("rate_limit_exceeded");
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }

    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).code(code);
        e.retry_after_s = Some(1);
        e
    }

    pub fn internal(message: impl Into<String>, code: &'static str) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message).code(code)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).code("not_found")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed on this path",
        )
        .code("method_not_allowed")
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn param(mut self, param: impl Into<Box<str>>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// The JSON body (also what a stream sends as its last event when a request fails mid-way).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            self.body().to_string(),
        )
            .into_response();
        if let Some(s) = self.retry_after_s
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        r
    }
}
