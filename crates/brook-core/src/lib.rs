//! brook-core
