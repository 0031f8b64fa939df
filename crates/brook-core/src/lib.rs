//! brook-core
pub mod text;
