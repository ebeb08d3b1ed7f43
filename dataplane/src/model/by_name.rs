//! Objects kept in persistent sets under their own names.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::sync::Arc;

use super::{EndpointSlice, ObjectName, Service};

/// An object that carries its name.
pub trait Named {
    fn object_name(&self) -> &ObjectName;
}

impl Named for Service {
    fn object_name(&self) -> &ObjectName {
        &self.name
    }
}

impl Named for EndpointSlice {
    fn object_name(&self) -> &ObjectName {
        &self.name
    }
}

/// An object in a persistent set, ordered and found by its own name: an entry is one pointer,
/// where a map from the name held a second copy of the name beside it (40 bytes an entry, in
/// nodes about half full).
///
/// Equal means the same name: compare the objects themselves for equal contents.
#[derive(Debug)]
pub struct ByName<T>(pub Arc<T>);

impl<T> Clone for ByName<T> {
    fn clone(&self) -> ByName<T> {
        ByName(self.0.clone())
    }
}

impl<T: Named> ByName<T> {
    pub fn name(&self) -> &ObjectName {
        self.0.object_name()
    }
}

impl<T: Named> PartialEq for ByName<T> {
    fn eq(&self, other: &ByName<T>) -> bool {
        self.name() == other.name()
    }
}

impl<T: Named> Eq for ByName<T> {}

impl<T: Named> PartialOrd for ByName<T> {
    fn partial_cmp(&self, other: &ByName<T>) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T: Named> Ord for ByName<T> {
    fn cmp(&self, other: &ByName<T>) -> Ordering {
        self.name().cmp(other.name())
    }
}

impl<T: Named> Borrow<ObjectName> for ByName<T> {
    fn borrow(&self) -> &ObjectName {
        self.name()
    }
}
