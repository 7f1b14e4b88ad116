//! Pairings: the secret a `tcp` initiator proves before its target reads a single frame.
//!
//! # Spec
//! - The target issues a pairing per initiator ([`crate::KvTransport::pair`]): a random 64-bit
//!   id and a random 256-bit secret, from the operating system's CSPRNG. The secret travels only
//!   over the authenticated control plane (mutual TLS between the nodes) and is never logged.
//! - At connect both sides prove the secret, each over a nonce the other chose
//!   ([`crate::tcp`]'s auth exchange): HMAC-SHA-256 with a label per direction, so no proof can
//!   be replayed on another connection or reflected back as the other side's.
//! - Region keys are minted from the same source: random, checked against every key the
//!   transport ever issued, so a key is never reused.

use ring::rand::SecureRandom;

use crate::TransportError;

/// Bytes of a pairing secret.
pub const SECRET_BYTES: usize = 32;

/// One initiator's right to connect to a target's `tcp` transport. `Debug` never shows the
/// secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Pairing {
    id: u64,
    secret: [u8; SECRET_BYTES],
}

impl std::fmt::Debug for Pairing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pairing")
            .field("id", &format_args!("{:#018x}", self.id))
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl Pairing {
    /// A fresh pairing: random id and secret.
    pub fn generate() -> Result<Self, TransportError> {
        let mut secret = [0u8; SECRET_BYTES];
        fill_random(&mut secret)?;
        Ok(Self {
            id: random_u64()?,
            secret,
        })
    }

    /// The pairing a target issued, as received over the control plane.
    pub fn from_parts(id: u64, secret: &[u8]) -> Result<Self, TransportError> {
        let secret: [u8; SECRET_BYTES] = secret.try_into().map_err(|_| {
            TransportError::Auth(format!(
                "a pairing secret is {SECRET_BYTES} bytes, got {}",
                secret.len()
            ))
        })?;
        Ok(Self { id, secret })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The secret, to hand to the paired initiator over the authenticated control plane.
    pub fn secret(&self) -> &[u8; SECRET_BYTES] {
        &self.secret
    }
}

/// Fill `buf` from the operating system's CSPRNG.
pub(crate) fn fill_random(buf: &mut [u8]) -> Result<(), TransportError> {
    ring::rand::SystemRandom::new()
        .fill(buf)
        .map_err(|_| TransportError::Entropy)
}

/// 64 random bits from the OS CSPRNG.
pub fn random_u64() -> Result<u64, TransportError> {
    let mut b = [0u8; 8];
    fill_random(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub(crate) fn random_u32() -> Result<u32, TransportError> {
    let mut b = [0u8; 4];
    fill_random(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairings_are_random_and_debug_hides_the_secret() {
        let (a, b) = (Pairing::generate().unwrap(), Pairing::generate().unwrap());
        assert_ne!(a.id(), b.id());
        assert_ne!(a.secret(), b.secret());
        let shown = format!("{a:?}");
        assert!(shown.contains("redacted"), "{shown}");
        let hex: String = a.secret().iter().map(|x| format!("{x:02x}")).collect();
        assert!(!shown.contains(&hex[..8]), "{shown}");
        let back = Pairing::from_parts(a.id(), a.secret()).unwrap();
        assert_eq!(back, a);
        assert!(Pairing::from_parts(1, &[0u8; 16]).is_err());
    }
}
