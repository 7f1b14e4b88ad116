//! The doors around safety property 1 ("no stale read") that are shut by type, each checked by
//! the compiler: every block below marked `compile_fail` is code that must not compile, and
//! the control after it is the same intent through the way that exists (so a `compile_fail`
//! cannot pass because of a typo). `cargo test -p custody-engine --doc` runs them.
//!
//! Page bytes leave or enter a pool only through the capabilities `kv` mints from its own tags
//! ([`SendGrant`], [`LandGrant`]); an engine lends its pool out only as a [`PoolView`].
//!
//! An engine's pool is not lent as `&PagePool` (whose owner could mint grants) …
//! ```compile_fail
//! fn door(e: &custody_engine::Engine) -> &custody_engine::kv::PagePool {
//!     e.pool()
//! }
//! ```
//! … nor as `&mut PagePool` to the decode role's transport (it lends a [`Landing`]):
//! ```compile_fail
//! fn door(d: &mut custody_engine::DecodeEngine) -> &mut custody_engine::kv::PagePool {
//!     d.landing_pool()
//! }
//! ```
//! ```
//! fn control(e: &custody_engine::Engine, d: &mut custody_engine::DecodeEngine) -> usize {
//!     let _landing: custody_engine::kv::Landing<'_> = d.landing();
//!     e.pool().n_free()
//! }
//! ```
//! No page bytes without a grant, even from a pool one owns:
//! ```compile_fail
//! fn door(p: &custody_engine::kv::PagePool) {
//!     p.for_each_transfer_chunk(0, 1, |_, _| {});
//! }
//! ```
//! ```compile_fail
//! fn door(p: &custody_engine::kv::PagePool) -> u64 {
//!     p.page_checksum(0, 1)
//! }
//! ```
//! ```compile_fail
//! fn door(v: custody_engine::kv::PoolView<'_>) {
//!     v.transfer_chunks(0, |_, _| {});
//! }
//! ```
//! ```
//! use custody_engine::kv::{GrantError, PoolView, SendGrant};
//! fn control(v: PoolView<'_>, g: &SendGrant) -> Result<u64, GrantError> {
//!     v.transfer_chunks(g, 0, |_, _| {})?;
//!     v.transfer_checksum(g, 0)
//! }
//! ```
//! No landing without the reservation's grant:
//! ```compile_fail
//! fn door(p: &mut custody_engine::kv::PagePool) {
//!     p.land(0, 0, &[0u8; 64]).unwrap();
//! }
//! ```
//! ```compile_fail
//! fn door(p: &mut custody_engine::kv::PagePool) {
//!     p.land_dest(0, 0, 64).unwrap();
//! }
//! ```
//! ```compile_fail
//! fn door(p: &mut custody_engine::kv::PagePool) {
//!     p.land_done(0, 0, 64).unwrap();
//! }
//! ```
//! ```compile_fail
//! fn door(d: &mut custody_engine::DecodeEngine) {
//!     d.landing().land(0, 0, &[0u8; 64]).unwrap();
//! }
//! ```
//! ```
//! use custody_engine::kv::{LandError, LandGrant};
//! fn control(d: &mut custody_engine::DecodeEngine, g: &LandGrant) -> Result<(), LandError> {
//!     d.landing().land(g, 0, 0, &[0u8; 64])
//! }
//! ```
//! Grants are not forged:
//! ```compile_fail
//! let g = custody_engine::kv::SendGrant { pool: 1, pages: Vec::new() };
//! ```
//! ```compile_fail
//! let g = custody_engine::kv::LandGrant { pool: 1, owner: 7, pages: Vec::new() };
//! ```
//! ```compile_fail
//! fn door(g: &custody_engine::kv::SendGrant) -> custody_engine::kv::SendGrant {
//!     g.clone()
//! }
//! ```
//! ```
//! // A grant is minted by a pool from its own tags (here one the caller owns) and read once.
//! use custody_engine::kv::{GrantError, PagePool, SendGrant};
//! fn control(p: &PagePool, owner: &custody_engine::kv::Reader) -> Result<SendGrant, GrantError> {
//!     p.grant_send(owner, &[], 0)
//! }
//! ```
//! A role's engine core is read-only from outside (no field, no `&mut`):
//! ```compile_fail
//! fn door(p: &custody_engine::PrefillEngine) -> usize {
//!     p.core().pool.n_free()
//! }
//! ```
//! ```
//! fn control(p: &custody_engine::PrefillEngine) -> usize {
//!     p.core().pool().n_free()
//! }
//! ```
//!
//! [`SendGrant`]: crate::kv::SendGrant
//! [`LandGrant`]: crate::kv::LandGrant
//! [`PoolView`]: crate::kv::PoolView
//! [`Landing`]: crate::kv::Landing
