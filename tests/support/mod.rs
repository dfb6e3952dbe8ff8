//! Test support: real servers spawned on free loopback ports.

#![allow(dead_code)] // Each test crate uses a different part.

pub(crate) mod redis;
