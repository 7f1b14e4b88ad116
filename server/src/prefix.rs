//! The prefix cache's namespaces, derived here — where the tenant was authenticated — and
//! handed to the engine with each request (`GenerateRequest::cache`).
//!
//! A request's private namespace is HMAC(server secret, its *authenticated* tenant ‖ its
//! `cache_salt`): nothing a client sends can name another tenant's namespace. Its public scope,
//! if any, is the operator-declared prefix its prompt shares the most tokens with; the engine
//! puts only pages wholly inside that shared run into the public namespace.

use std::sync::Arc;

use custody_runtime::Tokenizer;
use custody_runtime::prefix_cache::{CacheScope, NamespaceSecret, PublicPrefix};

use crate::ServeError;
use crate::config::PrefixCacheSection;

/// The server's namespace material: the secret, the public scopes (tokenized once), and the
/// incident reproduction's switch.
#[derive(Debug)]
pub struct PrefixScopes {
    secret: NamespaceSecret,
    public: Vec<PublicPrefix>,
    /// `[unsafe_reproduction] shared_prefix_cache`: every request in one namespace.
    unsafe_global: bool,
}

impl PrefixScopes {
    /// Read the secret (or draw one) and tokenize the public scopes.
    pub fn new(
        cfg: &PrefixCacheSection,
        tokenizer: &Tokenizer,
        unsafe_global: bool,
    ) -> Result<Self, ServeError> {
        let secret = match &cfg.secret_file {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| {
                    ServeError::Config(format!(
                        "serve.prefix_cache.secret_file {}: {e}",
                        p.display()
                    ))
                })?;
                NamespaceSecret::from_hex(&text).map_err(|e| {
                    ServeError::Config(format!(
                        "serve.prefix_cache.secret_file {}: {e}",
                        p.display()
                    ))
                })?
            }
            None => NamespaceSecret::generate()
                .map_err(|e| ServeError::Startup(format!("prefix-cache secret: {e}")))?,
        };
        let mut public = Vec::with_capacity(cfg.public.len());
        for p in &cfg.public {
            let tokens = match (&p.text, &p.system_prompt) {
                (Some(t), _) => tokenizer.encode(t, false),
                (None, Some(sys)) => tokenizer.encode_chat(&[custody_runtime::ChatMessage {
                    role: "system".into(),
                    content: sys.clone(),
                }]),
                (None, None) => unreachable!("validated: one of text and system_prompt"),
            }
            .map_err(|e| {
                ServeError::Config(format!(
                    "serve.prefix_cache.public {}: cannot tokenize: {e}",
                    p.scope
                ))
            })?;
            public.push(PublicPrefix {
                namespace: secret.public(&p.scope),
                tokens: tokens.into(),
            });
        }
        Ok(Self {
            secret,
            public,
            unsafe_global,
        })
    }

    /// The scope of a request of authenticated `tenant` with `salt` and `prompt`.
    pub fn scope(&self, tenant: &str, salt: Option<&str>, prompt: &[u32]) -> CacheScope {
        if self.unsafe_global {
            return CacheScope {
                private: self.secret.unsafe_global(),
                public: None,
            };
        }
        let shared = |p: &PublicPrefix| {
            p.tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
        };
        let public = self
            .public
            .iter()
            .map(|p| (shared(p), p))
            .filter(|(n, _)| *n > 0)
            .max_by_key(|(n, _)| *n)
            .map(|(_, p)| p.clone());
        CacheScope {
            private: self.secret.private(tenant, salt),
            public,
        }
    }

    /// One line per public scope for the audit log's `node_events` (`prefix_scope`): its name,
    /// its length in tokens and its namespace tag.
    pub fn describe(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .public
            .iter()
            .map(|p| {
                format!(
                    "scope={} tokens={} namespace={:016x}",
                    p.namespace.label(),
                    p.tokens.len(),
                    p.namespace.tag()
                )
            })
            .collect();
        if self.unsafe_global {
            v.push(format!(
                "scope=unsafe:global namespace={:016x} (UNSAFE: tenants share one namespace)",
                self.secret.unsafe_global().tag()
            ));
        }
        v
    }
}

/// Shared with the request handlers.
pub type SharedScopes = Arc<PrefixScopes>;
