//! TEMPORARY stand-in until the config module lands.
use serde::{Deserialize, Serialize};
/// tmp
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GatingMode { /// b
 Blocking, /// c
 Classifying }
/// tmp
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit { /// r
 Requests, /// t
 Tokens, /// b
 Bytes }
/// tmp
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rounding { /// f
 Floor, /// c
 Ceil, /// a
 AtLeastOne }
/// tmp
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogFormat { /// t
 Text, /// j
 Json }
